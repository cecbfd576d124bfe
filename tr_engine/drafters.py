"""Drafters propose the tokens a verify step checks: a draft tree and its tokens, the root first.

All of them share verify, accept and compact (tr_engine/speculative.py). Token Recycling reads its drafts from the
recycling matrix and learns from every verify; prompt lookup copies the continuation of the latest earlier match of
the last few tokens, as a chain; hybrid drafting merges the two into one tree. After each verify a drafter observes
the step: the logits at every node, the tokens committed (the greedy continuation) and the seconds the step took
(drafting to compaction), which the adaptive tree prices its sizes by.
"""

from dataclasses import dataclass

import torch

from tr_engine.adaptive import AdaptiveTrees, ChainStats
from tr_engine.matrix import RecyclingMatrix
from tr_engine.tree import DraftTree, chain_tree, graft_chain


@dataclass
class Draft:
    tree: DraftTree
    tokens: torch.Tensor  # [tree.size] int64 on the model's device, the root first


class TokenRecycling:
    """Retrieve from the matrix along a tree; recycle every verify's top-k back into it. The tree is static (the
    paper's), or with `adaptive` chosen each step for this machine's verify cost (tr_engine/adaptive.py)."""

    name = "tr"

    def __init__(self, matrix: RecyclingMatrix, tree: DraftTree, adaptive: AdaptiveTrees | None = None):
        self.matrix, self.tree, self.adaptive = matrix, tree.to(matrix.table.device), adaptive
        self._root, self._prefix = None, 0

    def propose(self, history: list[int]) -> Draft:
        return self.draft(history, self.plan(history)[0] if self.adaptive else self.tree)

    def plan(self, history: list[int], chain: list[int] = (), chain_values: list[float] = ()) -> tuple[DraftTree, int]:
        """The adaptive tree for this step (from the root's candidates in the matrix) and the chain tokens to add."""
        self._prefix = len(history)
        table, confidence = self.matrix.host()  # (on a GPU a CPU mirror: the plan reads many rows)
        return self.adaptive.plan(table, confidence, history[-1], len(history), chain, chain_values)

    def draft(self, history: list[int], tree: DraftTree) -> Draft:
        self._root = history[-1]
        root = torch.tensor(self._root, device=self.matrix.table.device)
        return Draft(tree, self.matrix.retrieve(root, tree))

    def observe(self, draft: Draft, logits: torch.Tensor, committed: list[int], seconds: float = 0.0) -> None:
        if self.adaptive is not None:  # how the committed path fared in the rows that drafted it, before recycling
            table, confidence = self.matrix.host()
            path = torch.tensor([self._root] + committed[:-1], device=table.device)
            self.adaptive.observe(table[path].tolist(), confidence[path].tolist(), committed)
            if seconds > 0.0:
                self.adaptive.observe_step(draft.tree.size, self._prefix, seconds)
        self.matrix.recycle_(draft.tokens, logits)


class PromptLookup:
    """Prompt lookup decoding: find the latest earlier occurrence of the last n tokens (n = max_ngram … 1) in the
    prompt and output so far, and draft the up to `length` tokens that followed it."""

    name = "pld"

    def __init__(self, device, length: int = 10, max_ngram: int = 3):
        self.device, self.length, self.max_ngram = device, length, max_ngram
        self.chains = [chain_tree(n).to(device) for n in range(length + 1)]

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

    def observe(self, draft: Draft, logits: torch.Tensor, committed: list[int], seconds: float = 0.0) -> None:
        pass


class Hybrid:
    """Token Recycling's tree with prompt lookup's chain merged in: the chain follows the tree's nodes while their
    tokens agree and hangs its remaining tokens under the last one, so copy-heavy text gets long copied branches and
    everything else keeps the matrix's drafts. With an adaptive tree the chain's length is chosen with the tree's
    size, by the same expected-tokens-per-cost rule; otherwise the whole chain is added to the static tree."""

    name = "hybrid"

    def __init__(self, tr: TokenRecycling, lookup: PromptLookup):
        self.tr, self.lookup = tr, lookup
        self.chain_stats = ChainStats(lookup.length)
        self._chain: list[int] = []
        self._grafted: dict[tuple, DraftTree] = {}

    @property
    def adaptive(self) -> AdaptiveTrees | None:
        return self.tr.adaptive

    @property
    def matrix(self) -> RecyclingMatrix:
        return self.tr.matrix

    def propose(self, history: list[int]) -> Draft:
        chain = self._chain = self.lookup.lookup(history)
        if self.tr.adaptive is not None:
            tree, m = self.tr.plan(history, chain, self.chain_stats.values(len(chain)))
            chain = chain[:m]
        else:
            tree = self.tr.tree
        draft = self.tr.draft(history, tree)
        if not chain:
            return draft
        tokens = draft.tokens.tolist()
        node, j = 0, 0
        while j < len(chain):  # follow the tree while it already drafts the chain's tokens
            child = next((c for c in tree.children[node] if tokens[c] == chain[j]), None)
            if child is None:
                break
            node, j = child, j + 1
        if j == len(chain):
            return draft
        key = (tree.paths, node, len(chain) - j)
        grafted = self._grafted.get(key)
        if grafted is None:
            if len(self._grafted) > 1024:
                self._grafted.clear()
            grafted = self._grafted[key] = graft_chain(tree, node, len(chain) - j)
        rest = torch.tensor(chain[j:], dtype=torch.long, device=draft.tokens.device)
        return Draft(grafted, torch.cat([draft.tokens, rest]))

    def observe(self, draft: Draft, logits: torch.Tensor, committed: list[int], seconds: float = 0.0) -> None:
        if self._chain:
            self.chain_stats.observe(self._chain, committed)
        self.tr.observe(draft, logits, committed, seconds)
