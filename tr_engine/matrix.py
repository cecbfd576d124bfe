"""The recycling matrix M [V, k]: row t holds the top-k tokens the model most recently predicted after token t.

It starts as all zeros (the paper's choice), lives across turns and requests ("hot start"), and can be saved to a
file that records the vocabulary size and a fingerprint of the tokenizer, so it is never loaded for another
vocabulary.
"""

from pathlib import Path

import os

import torch

from tr_engine import reference
from tr_engine.errors import UserError
from tr_engine.tree import DraftTree


class RecyclingMatrix:
    """`update` is the recycle op (tr_engine.ops: the kernel or its reference), with recycle_update_'s contract.

    Beside each row's ids it keeps their confidence: the softmax of the row's k logits when it was written (the
    candidates' shares of the row's top-k mass; 0 for a row never written). The adaptive tree reads it to spend its
    nodes where the model was sure (tr_engine/adaptive.py); the paper's static tree ignores it."""

    def __init__(self, vocab_size: int, k: int = 8, device="cpu", update=reference.recycle_update_):
        if k < 1:
            raise UserError(f"--matrix-k must be at least 1, got {k}")
        self.table = torch.zeros(vocab_size, k, dtype=torch.long, device=device)  # [V, k] token ids
        self.confidence = torch.zeros(vocab_size, k, dtype=torch.float16, device=device)  # [V, k]
        self.update = update

    @property
    def k(self) -> int:
        return self.table.shape[1]

    def retrieve(self, root: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """Expand the tree breadth-first from `root` ([] int64): node [.., i] is rank i of its parent's row.
        Returns the verify step's tokens [n+1], the root first."""
        tokens = torch.empty(tree.size, dtype=torch.long, device=self.table.device)
        tokens[0] = root
        for start, end in tree.levels:  # one gather per depth: parents are all in earlier levels
            tokens[start:end] = self.table[tokens[tree.parent[start:end]], tree.rank[start:end]]
        return tokens

    def recycle_(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Every verify token's row <- the top-k of the logits at its node ([T] ids, [T, V] logits), and its
        confidences <- their softmax; a token at several nodes takes the last node's, in breadth-first order."""
        self.update(self.table, tokens, logits)
        ids = tokens.tolist()
        last = sorted({t: i for i, t in enumerate(ids)}.values())  # the node each row was written from
        if len(last) < len(ids):
            where = torch.tensor(last, device=tokens.device)
            tokens, logits = tokens[where], logits[where]
        self.confidence[tokens] = logits.gather(1, self.table[tokens]).float().softmax(dim=-1).half()

    def clear_(self) -> None:
        """Back to the state of a new matrix (a cold start)."""
        self.table.zero_()
        self.confidence.zero_()

    def seed_(self, prompt_ids: list[int], logits: torch.Tensor) -> None:
        """Seed from a prefill: each prompt token's row <- the top-k of the logits at its position."""
        self.recycle_(torch.tensor(prompt_ids, device=self.table.device), logits)

    def save(self, path: str | Path, fingerprint: str) -> None:
        """Write atomically (a temporary file, then a rename), so an interrupted save leaves the old file intact."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"table": self.table.cpu(), "confidence": self.confidence.cpu(), "vocab_size": self.table.shape[0],
                    "fingerprint": fingerprint}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int, fingerprint: str, device="cpu") -> "RecyclingMatrix":
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
            table, saved_vocab, saved_fp = data["table"], data["vocab_size"], data["fingerprint"]
        except FileNotFoundError:
            raise UserError(f"no recycling matrix at {path}; drop --matrix to start from an empty one")
        except Exception as e:  # corrupt or foreign file: torch raises several types
            raise UserError(f"{path} is not a recycling matrix file ({type(e).__name__}); delete it to start fresh")
        if saved_vocab != vocab_size or saved_fp != fingerprint:
            raise UserError(f"{path} was made for another vocabulary ({saved_vocab} tokens, tokenizer {saved_fp}; "
                            f"this model: {vocab_size}, {fingerprint}); delete it or use another --matrix file")
        m = cls(vocab_size, table.shape[1], device)
        m.table.copy_(table)
        confidence = data.get("confidence")
        if isinstance(confidence, torch.Tensor) and confidence.shape == table.shape:
            m.confidence.copy_(confidence)
        else:  # a file from before confidences were kept: every written row as flat as can be
            m.confidence.copy_((table != 0).any(dim=1, keepdim=True).expand_as(table) / table.shape[1])
        return m
