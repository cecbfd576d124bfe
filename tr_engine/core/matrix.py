"""The recycling matrix M [V, k]: row t holds the top-k tokens the model most recently predicted after token t.

It starts as all zeros (the paper's choice), lives across turns and requests ("hot start"), and can be saved to a
file that records the vocabulary size and a fingerprint of the tokenizer, so it is never loaded for another
vocabulary.
"""

import io
from pathlib import Path

import torch

from tr_engine.core.methods import MAX_MATRIX_K
from tr_engine.core.tree import DraftTree
from tr_engine.errors import InvalidValue, MatrixFileError
from tr_engine.files import atomic_write, load_state, signals_deferred
from tr_engine.model.ops import resolve_ops


class RecyclingMatrix:
    """`ops` (tr_engine.model.ops: a spec or a namespace, the pure-PyTorch reference by default) supplies
    recycle_update_.

    Beside each row's ids it keeps their confidence: the softmax of the row's k logits when it was written (the
    candidates' shares of the row's top-k mass; 0 for a row never written). The adaptive tree reads it to spend its
    nodes where the model was sure (tr_engine/core/adaptive.py); the paper's static tree ignores it."""

    def __init__(self, vocab_size: int, k: int = 8, device="cpu", ops="reference"):
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(MAX_MATRIX_K, vocab_size):
            raise InvalidValue(f"--matrix-k must be an integer between 1 and {min(MAX_MATRIX_K, vocab_size)} (the "
                               f"candidates kept per token), got {k!r}")
        self.table = torch.zeros(vocab_size, k, dtype=torch.long, device=device)  # [V, k] token ids
        self.confidence = torch.zeros(vocab_size, k, dtype=torch.float16, device=device)  # [V, k]
        self.ops = resolve_ops(ops)
        # On a GPU the adaptive tree reads hundreds of rows a step on the host; each read of device memory would be a
        # sync, so it reads a CPU mirror that recycle_ keeps current instead (host()).
        self.mirrored = self.table.device.type != "cpu"
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None

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
        self.ops.recycle_update_(self.table, tokens, logits)
        ids = tokens.tolist()
        last = sorted({t: i for i, t in enumerate(ids)}.values())  # the node each row was written from
        top = logits.gather(1, self.table[tokens])  # [T, k]: a row's logits at its token's new ids (right for `last`)
        if len(last) < len(ids):  # (the k values of those rows picked, not their whole rows of logits copied)
            where = torch.tensor(last, device=tokens.device)
            tokens, top = tokens[where], top[where]
        self.confidence[tokens] = top.float().softmax(dim=-1).half()
        if self._host is not None:  # the rows just written, to the mirror: one small copy, not one per read
            rows = torch.tensor([ids[i] for i in last])
            self._host[0][rows] = self.table[tokens].cpu()
            self._host[1][rows] = self.confidence[tokens].cpu()

    def recycle_top_(self, tokens: torch.Tensor, top_values: torch.Tensor, top_ids: torch.Tensor) -> None:
        """recycle_ from each node's top-k alone ([T, k] values and ids, best first, as a stable top-k of the logits
        gives them): under tensor parallelism, merged from the ranks' shards (Shard.topk) instead of gathering whole
        rows of logits. The same rows and confidences as recycle_ on the whole logits."""
        ids = tokens.tolist()
        last = sorted({t: i for i, t in enumerate(ids)}.values())  # a token at several nodes: the last one's
        where = torch.tensor(last, device=tokens.device)
        tokens, top_values, top_ids = tokens[where], top_values[where], top_ids[where]
        self.table[tokens] = top_ids
        self.confidence[tokens] = top_values.float().softmax(dim=-1).half()
        if self._host is not None:
            rows = tokens.cpu()
            self._host[0][rows] = top_ids.cpu()
            self._host[1][rows] = self.confidence[tokens].cpu()

    def host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(table, confidence) for reading on the host: the tensors themselves on a CPU, else the CPU mirror."""
        if not self.mirrored:
            return self.table, self.confidence
        if self._host is None:
            self._host = (self.table.to("cpu", copy=True), self.confidence.to("cpu", copy=True))
        return self._host

    def copy_(self, table: torch.Tensor, confidence: torch.Tensor) -> None:
        """Replace the whole matrix (a loaded or saved state), mirror included."""
        self.table.copy_(table)
        self.confidence.copy_(confidence)
        self._host = None

    def clear_(self) -> None:
        """Back to the state of a new matrix (a cold start)."""
        self.table.zero_()
        self.confidence.zero_()
        self._host = None

    def seed_(self, prompt_ids: list[int], logits: torch.Tensor) -> None:
        """Seed from a prefill: each prompt token's row <- the top-k of the logits at its position."""
        self.recycle_(torch.tensor(prompt_ids, device=self.table.device), logits)

    def save(self, path: str | Path, fingerprint: str) -> None:
        """Write the matrix to `path` atomically (tr_engine/files.py): a failed or interrupted save keeps the old file
        and leaves no temporary one. Raises MatrixFileError saying why and what to do."""
        state = {"table": self.table.cpu(), "confidence": self.confidence.cpu(), "vocab_size": self.table.shape[0],
                 "fingerprint": fingerprint}
        buffer = io.BytesIO()  # serialised in memory first: torch's file writer reports a full disk as RuntimeError
        try:
            with signals_deferred():  # Ctrl-C during the save: it completes, then the interrupt is delivered
                torch.save(state, buffer)
                atomic_write(path, buffer.getvalue())
        except OSError as e:
            raise MatrixFileError(f"could not save the recycling matrix to {path} ({e.strerror or e}); any previous "
                                  "file there is kept; give --matrix a writable file (or --no-persist in the chat)"
                                  ) from None

    @classmethod
    def load(cls, path: str | Path, vocab_size: int, fingerprint: str, device="cpu") -> "RecyclingMatrix":
        """Read a matrix saved by `save` for this vocabulary. Its contents are checked (shapes, dtypes, token ids,
        confidences) before anything uses them: a file edited, truncated or written by something else is refused
        with a MatrixFileError, never loaded to fail later in a kernel."""
        data = load_state(path, MatrixFileError, "recycling matrix", "--matrix")
        table, confidence = _checked(data, path, vocab_size, fingerprint)
        m = cls(vocab_size, table.shape[1], device)
        m.table.copy_(table)
        if confidence is not None:
            m.confidence.copy_(confidence)
        else:  # a file from before confidences were kept: every written row as flat as can be
            m.confidence.copy_((table != 0).any(dim=1, keepdim=True).expand_as(table) / table.shape[1])
        return m


def _checked(data, path, vocab_size: int, fingerprint: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The table and the confidences (None in files older than them) of loaded file contents, after every check."""
    def bad(what: str) -> MatrixFileError:
        return MatrixFileError(f"{path} is not a valid recycling matrix file ({what}); delete it to start fresh")

    if not isinstance(data, dict) or not {"table", "vocab_size", "fingerprint"} <= data.keys():
        raise bad("not a dict with table, vocab_size and fingerprint")
    table, saved_vocab, saved_fp = data["table"], data["vocab_size"], data["fingerprint"]
    if type(saved_vocab) is not int or not isinstance(saved_fp, str):
        raise bad(f"its vocab_size is {_describe(saved_vocab)} and its fingerprint {_describe(saved_fp)}")
    if saved_vocab != vocab_size or saved_fp != fingerprint:
        raise MatrixFileError(f"{path} was made for another vocabulary ({saved_vocab} tokens, tokenizer {saved_fp}; "
                              f"this model: {vocab_size}, {fingerprint}); delete it or use another --matrix file")
    if not isinstance(table, torch.Tensor) or table.dtype != torch.long or table.dim() != 2:
        raise bad(f"its table is {_describe(table)}, not an int64 matrix [vocab, k]")
    if table.shape[0] != vocab_size or not 1 <= table.shape[1] <= MAX_MATRIX_K:
        raise bad(f"its table is {list(table.shape)}, not [{vocab_size}, k] with k in 1..{MAX_MATRIX_K}")
    if table.numel() and not (0 <= int(table.min()) and int(table.max()) < vocab_size):
        raise bad(f"token ids outside 0..{vocab_size - 1}")
    confidence = data.get("confidence")
    if confidence is None:
        return table, None
    if not (isinstance(confidence, torch.Tensor) and confidence.is_floating_point()
            and confidence.shape == table.shape):
        raise bad(f"its confidences are {_describe(confidence)}, not a float matrix {list(table.shape)}")
    if not bool(((confidence >= 0) & (confidence <= 1)).all()):  # NaN fails both
        raise bad("confidences outside [0, 1]")
    return table, confidence


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).removeprefix('torch.')} tensor of shape {list(x.shape)}"
    return f"a {type(x).__name__}"
