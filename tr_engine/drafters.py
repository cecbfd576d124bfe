"""Drafters propose the tokens a verify step checks: a draft tree and its tokens, the root first.

All of them share verify, accept and compact (tr_engine/speculative.py). Token Recycling reads its drafts from the
recycling matrix and learns from every verify; prompt lookup copies the continuation of the latest earlier match of
the last few tokens, as a chain.
"""

from dataclasses import dataclass

import torch

from tr_engine.matrix import RecyclingMatrix
from tr_engine.tree import DraftTree, chain_tree


@dataclass
class Draft:
    tree: DraftTree
    tokens: torch.Tensor  # [tree.size] int64 on the model's device, the root first


class TokenRecycling:
    """Retrieve from the matrix along a static tree; recycle every verify's top-k back into it."""

    name = "tr"

    def __init__(self, matrix: RecyclingMatrix, tree: DraftTree):
        self.matrix, self.tree = matrix, tree.to(matrix.table.device)
        self.max_step_tokens = tree.size

    def propose(self, history: list[int]) -> Draft:
        root = torch.tensor(history[-1], device=self.matrix.table.device)
        return Draft(self.tree, self.matrix.retrieve(root, self.tree))

    def observe(self, draft: Draft, logits: torch.Tensor) -> None:
        self.matrix.recycle_(draft.tokens, logits)


class PromptLookup:
    """Prompt lookup decoding: find the latest earlier occurrence of the last n tokens (n = max_ngram … 1) in the
    prompt and output so far, and draft the up to `length` tokens that followed it."""

    name = "pld"

    def __init__(self, device, length: int = 10, max_ngram: int = 3):
        self.device, self.length, self.max_ngram = device, length, max_ngram
        self.chains = [chain_tree(n).to(device) for n in range(length + 1)]
        self.max_step_tokens = length + 1

    def propose(self, history: list[int]) -> Draft:
        draft = self.lookup(history)
        tokens = torch.tensor([history[-1]] + draft, dtype=torch.long, device=self.device)
        return Draft(self.chains[len(draft)], tokens)

    def lookup(self, history: list[int]) -> list[int]:
        for n in range(min(self.max_ngram, len(history) - 1), 0, -1):
            tail = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):  # latest match first, excluding the tail itself
                if history[start : start + n] == tail:
                    return history[start + n : start + n + self.length]
        return []

    def observe(self, draft: Draft, logits: torch.Tensor) -> None:
        pass
