"""Drafters propose the tokens a verify step checks: a draft tree and its tokens, the root first.

All of them share verify, accept and compact (tr_engine/core/speculative.py). Token Recycling reads its drafts from the
recycling matrix and learns from every verify; prompt lookup copies the continuation of the latest earlier match of
the last few tokens, as a chain; hybrid drafting (tr_engine/core/hybrid.py) merges the two, and the suffix index's
continuations, into one tree.

A drafter is a class with a `name` and four calls (the Drafter protocol below), registered as a method in
tr_engine/core/methods.py's DRAFTERS:
- build(setup) -> drafter (a classmethod): one from what the engine offers (DrafterSetup: device, static tree,
  recycling matrix, adaptive planner), taking only what it uses;
- propose(history) -> Draft: retrieve, the tree and its tokens;
- learn(draft, committed, seconds): what the step teaches the planner: which candidates came true, and what the
  step cost (drafting to compaction), which the adaptive tree prices its sizes by;
- recycle(draft, logits): every node's top-k into the matrix.
Everything a step's later calls need from its proposal travels in the Draft, never on the drafter, so one drafter
serves many sequences at once (tr_engine/core/batch.py). A drafter may also offer propose_batch(histories) -> Drafts,
one step's drafts for several sequences planned together (the adaptive tree splits one forward's budget among them), and
recycle_batch(drafts, logits), their recycles in one update; without them, each sequence proposes and recycles alone.
It may offer remember(ids), handed each finished sequence (its prompt and answer: hybrid's suffix index learns
from them). And it may offer `top_k` (the k its recycling needs: 1 for none) and recycle_top(draft, values, ids), the
recycle from each node's top-k alone (values and ids [n+1, top_k], best first): a greedy step under tensor
parallelism then merges just those from the ranks' columns of the logits (tr_engine/model/parallel.py) instead of
gathering whole rows.
"""

from array import array
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Protocol

import torch

from tr_engine.core.adaptive import AdaptiveTrees, Candidates
from tr_engine.core.matrix import RecyclingMatrix
from tr_engine.core.suffix import Continuations, SuffixIndex
from tr_engine.core.tree import DraftTree, chain_tree, truncate_tree


@dataclass
class Draft:
    tree: DraftTree
    tokens: torch.Tensor  # [tree.size] int64 on the model's device, the root first
    root: int = 0  # the root's token: the last one committed
    prefix: int = 0  # tokens before this step (the context so far)
    chain: list[int] = field(default_factory=list)  # the chain prompt lookup found (hybrid), before any cut
    chain_ngram: int = 0  # how many of the history's last tokens the chain's match agreed with (PromptLookup.match)
    suffix: Continuations | None = None  # what the suffix index offered (hybrid with an index), before any cut
    sources: list[int] = field(default_factory=list)  # per node, the bits of the SOURCES that proposed it (root: 0)
    context: int = 0  # what the matrix's nodes were priced by (adaptive.CONTEXTS): 1 beside other sources' candidates

    def cut(self, size: int) -> "Draft":
        """This draft, or its first `size` nodes (breadth-first: every kept node's parent is kept) when it has more."""
        if self.tree.size <= size:
            return self
        return replace(self, tree=truncate_tree(self.tree, size), tokens=self.tokens[:size],
                       sources=self.sources[:size])


SOURCES = ("matrix", "lookup", "suffix")  # where a draft node came from: bit i is SOURCES[i]
MATRIX, LOOKUP, SUFFIX = 1, 2, 4


def source_names(bits: int) -> list[str]:
    """The SOURCES named by `bits`."""
    return [name for i, name in enumerate(SOURCES) if bits >> i & 1]


class DrafterSetup:
    """What the engine offers a drafter's build: the device, the static tree (DraftTree, cut to `max_tokens`), the
    suffix index of everything decoded so far (None when the engine keeps none), the most tokens a verify may take
    (the root included: --speculative-config's num_speculative_tokens + 1), and, made on first use, the recycling
    matrix and the adaptive tree's planner (None for a static tree)."""

    def __init__(self, device: torch.device, tree: DraftTree, matrix: Callable[[], RecyclingMatrix],
                 adaptive: Callable[[], AdaptiveTrees | None], suffix: SuffixIndex | None = None,
                 max_tokens: int | None = None):
        self.max_tokens = max_tokens  # (None: no limit but the trees' own)
        tree = tree if max_tokens is None or tree.size <= max_tokens else truncate_tree(tree, max_tokens)
        self.device, self.tree, self._matrix, self._adaptive, self.suffix = device, tree, matrix, adaptive, suffix

    @cached_property
    def matrix(self) -> RecyclingMatrix:
        return self._matrix()

    @cached_property
    def adaptive(self) -> AdaptiveTrees | None:
        return self._adaptive()


class Drafter(Protocol):
    name: str  # its method's name

    @classmethod
    def build(cls, setup: DrafterSetup) -> "Drafter": ...

    def propose(self, history: list[int]) -> Draft: ...

    def learn(self, draft: Draft, committed: list[int], seconds: float = 0.0) -> None: ...

    def recycle(self, draft: Draft, logits: torch.Tensor) -> None: ...


class TokenRecycling:
    """Retrieve from the matrix along a tree; recycle every verify's top-k back into it. The tree is static (the
    paper's), or with `adaptive` chosen each step for this machine's verify cost (tr_engine/core/adaptive.py)."""

    name = "tr"

    def __init__(self, matrix: RecyclingMatrix, tree: DraftTree, adaptive: AdaptiveTrees | None = None):
        self.matrix, self.tree, self.adaptive = matrix, tree.to(matrix.table.device), adaptive

    @classmethod
    def build(cls, setup: DrafterSetup) -> "TokenRecycling":
        return cls(setup.matrix, setup.tree, setup.adaptive)

    def propose(self, history: list[int]) -> Draft:
        if self.adaptive is None:
            return self.draft(history, self.tree)
        return self.draft(history, self.plan(history)[0], self.adaptive.tokens[0])

    def propose_batch(self, histories: list[list[int]]) -> list[Draft]:
        """One batched step's drafts: with the adaptive tree, planned together (AdaptiveTrees.plan)."""
        if self.adaptive is None:
            return [self.propose(h) for h in histories]
        table, confidence = self.matrix.host()
        plans = self.adaptive.plan(table, confidence, [h[-1] for h in histories], [len(h) for h in histories])
        return [self.draft(h, tree, tokens) for h, (tree, _), tokens in zip(histories, plans, self.adaptive.tokens)]

    def plan(self, history: list[int], extra: Candidates | None = None) -> tuple[DraftTree, list[int]]:
        """The adaptive tree for this step (from the root's candidates in the matrix) and the nodes of `extra`
        (candidates from outside the matrix) to add."""
        table, confidence = self.matrix.host()  # (on a GPU a CPU mirror: the plan reads many rows)
        return self.adaptive.plan(table, confidence, [history[-1]], [len(history)], extra and [extra])[0]

    def draft(self, history: list[int], tree: DraftTree, tokens: list[int] | None = None) -> Draft:
        """The draft of `tree` from the history's last token: its tokens gathered from the matrix, or `tokens` where
        the plan that chose the tree read them already (AdaptiveTrees.tokens: one copy, not a gather a depth)."""
        device = self.matrix.table.device
        if tokens is None:
            tokens = self.matrix.retrieve(torch.tensor(history[-1], device=device), tree)
        else:
            tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        return Draft(tree, tokens, root=history[-1], prefix=len(history), sources=[0] + [MATRIX] * (tree.size - 1))

    def learn(self, draft: Draft, committed: list[int], seconds: float = 0.0) -> None:
        if self.adaptive is not None:  # how the committed path fared in the rows that drafted it (before recycling)
            path = [draft.root] + committed[:-1]
            read = self.adaptive.rows  # (the rows this step's plan read, unchanged until the recycle after this)
            if all(t in read for t in path):
                ids, confidences = [read[t][0] for t in path], [read[t][1] for t in path]
            else:  # (a path through a node another source drafted, whose row the plan did not read: via numpy)
                table, confidence = self.matrix.host()
                ids, confidences = table.numpy()[path].tolist(), confidence.numpy()[path].tolist()
            self.adaptive.observe(ids, confidences, committed, draft.context)
            if seconds > 0.0:
                self.adaptive.observe_step(draft.tree.size, draft.prefix, seconds)

    def recycle(self, draft: Draft, logits: torch.Tensor) -> None:
        self.matrix.recycle_(draft.tokens, logits)

    @property
    def top_k(self) -> int:
        return self.matrix.k

    def recycle_top(self, draft: Draft, values: torch.Tensor, ids: torch.Tensor) -> None:
        self.matrix.recycle_top_(draft.tokens, values, ids)

    def recycle_batch(self, drafts: list[Draft], logits: torch.Tensor) -> None:
        """A batched step's recycle in one update: the drafts' tokens in order against all their logits rows (the
        last writer of a row wins, as one recycle per draft in this order would have it)."""
        self.matrix.recycle_(torch.cat([d.tokens for d in drafts]), logits)


class PromptLookup:
    """Prompt lookup decoding: find the latest earlier occurrence of the last n tokens (n = max_ngram … 1) in the
    prompt and output so far, and draft the up to `length` tokens that followed it."""

    name = "pld"
    LENGTH = 10  # the chain's length, at most

    def __init__(self, device, length: int = LENGTH, max_ngram: int = 3):
        self.device, self.length, self.max_ngram = device, length, max_ngram
        self.chains = [chain_tree(n).to(device) for n in range(length + 1)]

    @classmethod
    def build(cls, setup: DrafterSetup) -> "PromptLookup":
        return cls(setup.device, length=cls.LENGTH if setup.max_tokens is None else min(cls.LENGTH,
                                                                                        setup.max_tokens - 1))

    def propose(self, history: list[int]) -> Draft:
        draft = self.lookup(history)
        tokens = torch.tensor([history[-1]] + draft, dtype=torch.long, device=self.device)
        return Draft(self.chains[len(draft)], tokens, root=history[-1], prefix=len(history),
                     sources=[0] + [LOOKUP] * len(draft))

    def lookup(self, history: list[int]) -> list[int]:
        """The up to `length` tokens after the latest earlier occurrence of the history's last n tokens, for the
        longest n that has one (match)."""
        return self.match(history)[0]

    def match(self, history: list[int]) -> tuple[list[int], int]:
        """lookup's tokens and the n its match agreed on (0: none), the first match of

            for n in max_ngram … 1: for start in len - n - 1 … 0: history[start : start + n] == history[-n:]

        found by bytes.rfind over the ids as 4-byte ints (a match at an offset that is not a multiple of 4 straddles
        two ids and is skipped), ~14x faster than that loop in Python: 13 us against 171 for a 400-token history,
        done for every sequence of every step (a batch of 8 spent ~0.6 ms a step in the loop)."""
        if len(history) < 2:
            return [], 0
        ids = array("i", history).tobytes()
        before_last = 4 * (len(history) - 1)  # a match must end before the tail's last token: not the tail itself
        for n in range(min(self.max_ngram, len(history) - 1), 0, -1):
            tail, end = ids[-4 * n :], before_last
            while (at := ids.rfind(tail, 0, end)) >= 0:
                if at % 4 == 0:
                    start = at // 4 + n
                    return history[start : start + self.length], n
                end = at + 4 * n - 1  # the next match to the left starts before this one
        return [], 0

    def learn(self, draft: Draft, committed: list[int], seconds: float = 0.0) -> None:
        pass  # nothing to learn: the text is the draft

    def recycle(self, draft: Draft, logits: torch.Tensor) -> None:
        pass  # no matrix

    top_k = 1  # (greedy acceptance's argmax alone)

    def recycle_top(self, draft: Draft, values: torch.Tensor, ids: torch.Tensor) -> None:
        pass
