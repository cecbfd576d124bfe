"""Hybrid drafting, the engine's default: Token Recycling's tree with prompt lookup's chain and the suffix index's
continuations merged in, one planner choosing among all three sources' candidates by what each has shown it is worth
(tr_engine/core/drafters.py holds the drafter protocol and the two drafters it merges).
"""

from bisect import bisect_right
from dataclasses import replace

import torch

from tr_engine.core.adaptive import AdaptiveTrees, Candidates, ChainStats, ConfidenceStats, confidence_bin, \
    context_of
from tr_engine.core.drafters import LOOKUP, SUFFIX, Draft, DrafterSetup, PromptLookup, TokenRecycling
from tr_engine.core.matrix import RecyclingMatrix
from tr_engine.core.suffix import MAX_MATCH, Continuations, SuffixIndex
from tr_engine.core.tree import DraftTree, TreeCache, graft

# A suffix node's run: how many tokens its match has agreed with by the time it drafts the node, if the node's path
# is right (the history's agreement, Continuations.agree, plus the node's depth less one). The longer a match has run,
# the likelier it goes on: on bench/data/memory.jsonl a match's next token was right 55-65% of the time after 3 tokens
# of agreement, ~90% after 8 to 31, 96-100% after 32 or more. The index's rates are learned by run class, from runs
# of 3 tokens (the index's ORDER: the first class) to MAX_MATCH and more (the last), and in each by confidence.
RUNS = (4, 6, 8, 12, 16, 24, MAX_MATCH)


def run_class(run: int) -> int:
    return bisect_right(RUNS, run)


class Hybrid:
    """Token Recycling's tree with the candidates of prompt lookup and, where the engine keeps one, of the suffix index
    merged in: each follows the tree's nodes while their tokens agree and hangs the rest under the last one, so
    copy-heavy text (the prompt's, or what earlier requests answered) gets long copied branches and everything else
    keeps the matrix's drafts. With an adaptive tree, which candidates join is chosen with the tree's size, by the
    same expected-tokens-per-cost rule, each source's candidates valued by the acceptance it has shown (ChainStats for
    prompt lookup's chain, apart by the n-gram its match agreed on; for the index's continuations, the rate learned
    for their run's class and confidence's bin, as the matrix's confidences are); otherwise every candidate is added
    to the static tree."""

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
            (tree, chosen), tokens = self.tr.plan(history, extra), self.tr.adaptive.tokens[0]
        else:  # the static tree, every candidate added (as many as the verify may take)
            tree, chosen, tokens = self.tr.tree, list(range(1, len(extra.parent))), None
        draft = replace(self.compose(history, tree, extra, chosen, found, tokens), chain_ngram=ngram, suffix=offered,
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
        return [replace(self.compose(h, tree, x, chosen, f, t), chain_ngram=n, suffix=o, context=context_of(x))
                for h, f, n, o, x, (tree, chosen), t in zip(histories, found, ngrams, offered, extras, plans,
                                                            self.tr.adaptive.tokens)]

    def offered(self, history: list[int]) -> Continuations | None:
        """The suffix index's continuations of the history (None without an index, or when it knows nothing)."""
        return self.suffix.continuations(history, self.SUFFIX_DEPTH) if self.suffix is not None else None

    def candidates(self, history: list[int], found: list[int], offered: Continuations | None = None,
                   ngram: int = 1) -> Candidates:
        """This step's candidates from outside the matrix: prompt lookup's chain (found by a match of `ngram`
        tokens), each token valued by the observed acceptance of chains of such matches, and the index's
        continuations, each node valued by its parent's value times the rate of its run's class and its empirical
        probability's bin (a candidate both offer is one node, worth the larger value)."""
        chain_stats = self.chain_stats[max(ngram, 1) - 1]  # (no match: an empty chain, any stats)
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
                found: list[int], tokens: list[int] | None = None) -> Draft:
        """The draft of `tree` from the matrix (its `tokens` where the plan read them) with the `chosen` nodes of
        `extra` (parents first) grafted in: each follows the tree while the tree already drafts its token, and hangs
        under its parent where it does not."""
        draft = replace(self.tr.draft(history, tree, tokens), chain=found)
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
            self.chain_stats[draft.chain_ngram - 1].observe(draft.chain, committed)  # (a chain: n >= 1)
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
