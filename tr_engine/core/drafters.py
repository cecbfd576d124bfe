"""Drafters propose the tokens a verify step checks: a draft tree and its tokens, the root first.

All of them share verify, accept and compact (tr_engine/core/speculative.py). Token Recycling reads its drafts from the
recycling matrix and learns from every verify; prompt lookup copies the continuation of the latest earlier match of
the last few tokens, as a chain; hybrid drafting merges the two into one tree.

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
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Protocol

import torch

from tr_engine.core.adaptive import AdaptiveTrees, Candidates, ChainStats, ConfidenceStats, confidence_bin, \
    context_of
from tr_engine.core.matrix import RecyclingMatrix
from tr_engine.core.suffix import MAX_MATCH, Continuations, SuffixIndex
from tr_engine.core.tree import DraftTree, TreeCache, chain_tree, graft, truncate_tree


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
        return self.draft(history, self.plan(history)[0] if self.adaptive else self.tree)

    def propose_batch(self, histories: list[list[int]]) -> list[Draft]:
        """One batched step's drafts: with the adaptive tree, planned together (AdaptiveTrees.plan)."""
        if self.adaptive is None:
            return [self.propose(h) for h in histories]
        table, confidence = self.matrix.host()
        plans = self.adaptive.plan(table, confidence, [h[-1] for h in histories], [len(h) for h in histories])
        return [self.draft(h, tree) for h, (tree, _) in zip(histories, plans)]

    def plan(self, history: list[int], extra: Candidates | None = None) -> tuple[DraftTree, list[int]]:
        """The adaptive tree for this step (from the root's candidates in the matrix) and the nodes of `extra`
        (candidates from outside the matrix) to add."""
        table, confidence = self.matrix.host()  # (on a GPU a CPU mirror: the plan reads many rows)
        return self.adaptive.plan(table, confidence, [history[-1]], [len(history)], extra and [extra])[0]

    def draft(self, history: list[int], tree: DraftTree) -> Draft:
        root = torch.tensor(history[-1], device=self.matrix.table.device)
        return Draft(tree, self.matrix.retrieve(root, tree), root=history[-1], prefix=len(history),
                     sources=[0] + [MATRIX] * (tree.size - 1))

    def learn(self, draft: Draft, committed: list[int], seconds: float = 0.0) -> None:
        if self.adaptive is not None:  # how the committed path fared in the rows that drafted it (before recycling)
            table, confidence = self.matrix.host()  # (CPU tensors: read through numpy, as the plan reads them)
            path = [draft.root] + committed[:-1]
            self.adaptive.observe(table.numpy()[path].tolist(), confidence.numpy()[path].tolist(), committed,
                                  draft.context)
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


# A suffix node's run: how many tokens its match has agreed with by the time it drafts the node, if the node's path
# is right (the history's agreement, Continuations.agree, plus the node's depth less one). The longer a match has run,
# the likelier it goes on: on bench/data/memory.jsonl a match's next token was right 55-65% of the time after 3 tokens
# of agreement, ~90% after 8 to 31, 96-100% after 32 or more. The index's rates are learned by run class (the first
# class: runs of 3 tokens (the index's ORDER), the last: MAX_MATCH and more), and in each by its node's confidence.
RUNS = (4, 6, 8, 12, 16, 24, MAX_MATCH)


def run_class(run: int) -> int:
    return bisect_right(RUNS, run)


class Hybrid:
    """Token Recycling's tree with the candidates of prompt lookup and, where the engine keeps one, of the suffix index
    merged in: each follows the tree's nodes while their tokens agree and hangs the rest under the last one, so
    copy-heavy text (the prompt's, or what earlier requests answered) gets long copied branches and everything else
    keeps the matrix's drafts. With an adaptive tree, which candidates join is chosen with the tree's size, by the
    same expected-tokens-per-cost rule, each source's candidates valued by the acceptance it has shown (ChainStats for
    prompt lookup's chain, apart by the n-gram its match agreed on; for the index's continuations, the rate of their confidence's bin, learned as the matrix's
    confidences are); otherwise every candidate is added to the static tree."""

    name = "hybrid"
    # The longest continuation taken from the index. 32, not 16: on bench/data/memory.jsonl (amx, bf16, three runs of
    # both in one process, turn by turn) 1.013-1.027x the tokens per second, the repeats' turns most (faq 1.04-1.06x);
    # the dev split 0.995x (48 questions: noise). The planner takes a deep node only where its value pays; 48 or 64
    # (even only for matches agreeing on 8 or 32 tokens) gained less (1.006-1.021x).
    SUFFIX_DEPTH = 32

    def __init__(self, tr: TokenRecycling, lookup: PromptLookup, suffix: SuffixIndex | None = None,
                 max_tokens: int | None = None):
        self.tr, self.lookup, self.suffix, self.max_tokens = tr, lookup, suffix, max_tokens
        # The chain's acceptance, learned apart by the n its match agreed on: on the dev split (hybrid with an index)
        # a chain's first token came true 25% of the time after a 1-token match, 46% after 2, 73% after 3; learned
        # together, a 1-token match's chain was priced as a 3-token one's, and a 3-token match's as a 1-token one's.
        self.chain_stats = [ChainStats(lookup.length) for _ in range(lookup.max_ngram)]
        # The index's candidates' acceptance, by their run's class (RUNS): how far a match has agreed says much of how
        # far it goes on.
        self.suffix_stats = ConfidenceStats(len(RUNS) + 1)
        self._grafted = TreeCache(512)  # trees with candidates grafted on, by (tree, the grafts' parents)

    @classmethod
    def build(cls, setup: DrafterSetup) -> "Hybrid":
        return cls(TokenRecycling.build(setup), PromptLookup.build(setup), setup.suffix, setup.max_tokens)

    @property
    def adaptive(self) -> AdaptiveTrees | None:
        return self.tr.adaptive

    @property
    def matrix(self) -> RecyclingMatrix:
        return self.tr.matrix

    def propose(self, history: list[int]) -> Draft:
        (found, ngram), offered = self.lookup.match(history), self.offered(history)
        extra = self.candidates(history, found, offered, ngram)
        if self.tr.adaptive is not None:
            tree, chosen = self.tr.plan(history, extra)
        else:  # the static tree, every candidate added (as many as the verify may take)
            tree, chosen = self.tr.tree, list(range(1, len(extra.parent)))
        draft = replace(self.compose(history, tree, extra, chosen, found), chain_ngram=ngram, suffix=offered,
                        context=context_of(extra))
        return draft if self.max_tokens is None else draft.cut(self.max_tokens)

    def propose_batch(self, histories: list[list[int]]) -> list[Draft]:
        """One batched step's drafts: with the adaptive tree, trees and extra candidates planned together."""
        if self.tr.adaptive is None:
            return [self.propose(h) for h in histories]
        found, ngrams = zip(*(self.lookup.match(h) for h in histories))
        offered = [self.offered(h) for h in histories]
        extras = [self.candidates(h, f, o, n) for h, f, o, n in zip(histories, found, offered, ngrams)]
        table, confidence = self.matrix.host()
        plans = self.tr.adaptive.plan(table, confidence, [h[-1] for h in histories], [len(h) for h in histories],
                                      extras)
        return [replace(self.compose(h, tree, x, chosen, f), chain_ngram=n, suffix=o, context=context_of(x))
                for h, f, n, o, x, (tree, chosen) in zip(histories, found, ngrams, offered, extras, plans)]

    def offered(self, history: list[int]) -> Continuations | None:
        """The suffix index's continuations of the history (None without an index, or when it knows nothing)."""
        return self.suffix.continuations(history, self.SUFFIX_DEPTH) if self.suffix is not None else None

    def candidates(self, history: list[int], found: list[int], offered: Continuations | None = None,
                   ngram: int = 1) -> Candidates:
        """This step's candidates from outside the matrix: prompt lookup's chain (found by a match of `ngram`
        tokens), each token valued by the observed acceptance of chains of such matches, and the index's
        continuations, each valued by the rates of its path's empirical probabilities (a candidate both offer is one
        node, worth the larger value)."""
        chain_stats = self.chain_stats[max(ngram, 1) - 1]
        chain = Candidates.chain(history[-1], found, chain_stats.values(len(found)), LOOKUP)
        if offered is None:
            return chain
        rates = self.suffix_stats.rates()
        value, depth = [1.0], [0]
        for i in range(1, len(offered.parent)):
            up = offered.parent[i]
            depth.append(depth[up] + 1)
            rate = rates[run_class(offered.agree + depth[up])][confidence_bin(offered.confidence(i))]
            value.append(value[up] * rate)
        suffix = Candidates(offered.parent, offered.token, value, [0] + [SUFFIX] * (len(value) - 1))
        return suffix.merged(chain) if found else suffix

    def compose(self, history: list[int], tree: DraftTree, extra: Candidates, chosen: list[int],
                found: list[int]) -> Draft:
        """The draft of `tree` from the matrix with the `chosen` nodes of `extra` (parents first) grafted in: each
        follows the tree while the tree already drafts its token, and hangs under its parent where it does not."""
        draft = replace(self.tr.draft(history, tree), chain=found)
        tokens, sources, n = draft.tokens.tolist(), draft.sources, tree.size
        at, parents, new, added = {0: 0}, [], [], {}  # extra node -> token index; the grafted nodes
        for i in chosen:
            up, token = at[extra.parent[i]], extra.token[i]
            child = tree.child(up, tokens, token) if up < n else None
            if child is None:
                child = added.get((up, token))
            if child is None:
                child = added[(up, token)] = n + len(parents)
                parents.append(up)
                new.append(token)
                sources.append(0)
            sources[child] |= extra.source[i]  # (one node, however many sources proposed it)
            at[i] = child
        if not parents:
            return draft
        grafted = self._grafted.get((tree.paths, tuple(parents)), lambda: graft(tree, parents))
        rest = torch.tensor(new, dtype=torch.long, device=draft.tokens.device)
        return replace(draft, tree=grafted, tokens=torch.cat([draft.tokens, rest]))

    def learn(self, draft: Draft, committed: list[int], seconds: float = 0.0) -> None:
        if draft.chain:
            self.chain_stats[max(draft.chain_ngram, 1) - 1].observe(draft.chain, committed)
        if draft.suffix is not None:  # down the index's trie along the committed tokens: each node's children
            offered, kids = draft.suffix, draft.suffix.children()
            rows, probabilities, node = [], [], 0
            for target in committed:
                rows.append(list(kids[node]))
                probabilities.append([offered.confidence(c) for c in kids[node].values()])
                node = kids[node].get(target)
                if node is None:
                    break
            self.suffix_stats.observe(rows, probabilities, committed[: len(rows)],
                                      [run_class(offered.agree + d) for d in range(len(rows))])
        self.tr.learn(draft, committed, seconds)

    def remember(self, ids: list[int]) -> None:
        """A finished sequence (its prompt and answer), for the suffix index to draft from in later requests."""
        if self.suffix is not None:
            self.suffix.add(ids)

    def recycle(self, draft: Draft, logits: torch.Tensor) -> None:
        self.tr.recycle(draft, logits)

    @property
    def top_k(self) -> int:
        return self.tr.top_k

    def recycle_top(self, draft: Draft, values: torch.Tensor, ids: torch.Tensor) -> None:
        self.tr.recycle_top(draft, values, ids)

    def recycle_batch(self, drafts: list[Draft], logits: torch.Tensor) -> None:
        self.tr.recycle_batch(drafts, logits)
