"""Cost-aware adaptive draft trees: each step verifies the tree with the most expected accepted tokens per unit of
verify cost on this machine.

The paper expands a fixed 80-node tree. Which tree pays depends on two things it does not look at:
- how often each candidate is right. `RankStats` counts, online, how often the model's greedy next token is the
  rank-r entry of the previous token's matrix row, at each depth of a step. Every committed token is one observation
  for every rank at once (we look the token up in the row), whatever tree was verified, so the estimates cover nodes
  the current tree does not have.
- what verifying T tokens costs (tr_engine/cost.py: measured on this machine, in plain steps), corrected online by
  `StepTimes` from the decode loop's clock.

Assuming a node is accepted with the product of its path's per-depth rank rates, the expected tokens a step commits
are 1 (the bonus token) plus the sum of its nodes' path probabilities, and the best tree of n nodes is the n nodes
with the highest path probabilities (a child's is never above its parent's, so they form a tree). `AdaptiveTrees`
keeps those nodes sorted, and each step picks the size from the cost model's buckets that maximises
expected tokens / cost(size) — which may be a plain one-token step when nothing pays, as on a CPU in bf16.

Prompt lookup's chain (hybrid drafting) enters the same sum: its j-th token is right with the product of the first j
per-position rates that `ChainStats` learns, and the chain's length is chosen jointly with the tree's size.
"""

import heapq
from itertools import accumulate

from tr_engine.cost import BUCKETS, CostModel
from tr_engine.tree import DraftTree, build_tree

# Before any observation: a guess at how often rank r is right, and how many observations it weighs.
PRIOR = (0.30, 0.10, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01)
PRIOR_WEIGHT = 8.0
HALF_LIFE = 512  # observations; older ones fade, so the tree follows the text it is drafting


class RankStats:
    """Decayed counts of 'the greedy next token was rank r of the previous token's matrix row', by depth."""

    def __init__(self, k: int, max_depth: int = 12):
        self.k, self.max_depth = k, max_depth
        self.hits = [[0.0] * k for _ in range(max_depth)]
        self.tries = [0.0] * max_depth
        self.decay = 0.5 ** (1 / HALF_LIFE)

    def observe(self, rows: list[list[int]], targets: list[int]) -> None:
        """rows[d]: the matrix row (before this step's recycle) of the token at depth d of the committed path (the
        root first); targets[d]: the greedy token that followed it."""
        for d, (row, target) in enumerate(zip(rows[: self.max_depth], targets)):
            hits = self.hits[d]
            for r in range(self.k):
                hits[r] *= self.decay
            self.tries[d] = self.tries[d] * self.decay + 1
            if target in row:
                hits[row.index(target)] += 1  # the first rank holding it: the one accept would take

    def rates(self) -> list[list[float]]:
        """rates[d][r]: estimated P(rank r is right | the path reached depth d), shrunk towards the rate pooled over
        depths (deep positions are seen rarely), which is shrunk towards PRIOR."""
        prior = [PRIOR[r] if r < len(PRIOR) else PRIOR[-1] for r in range(self.k)]
        total = sum(self.tries)
        pooled = [(sum(h[r] for h in self.hits) + PRIOR_WEIGHT * prior[r]) / (total + PRIOR_WEIGHT)
                  for r in range(self.k)]
        return [[(self.hits[d][r] + PRIOR_WEIGHT * pooled[r]) / (self.tries[d] + PRIOR_WEIGHT) for r in range(self.k)]
                for d in range(self.max_depth)]


class ChainStats:
    """Decayed per-position acceptance of prompt lookup's chain: P(token j right | tokens before it right)."""

    def __init__(self, length: int):
        self.hits, self.tries = [0.0] * length, [0.0] * length
        self.decay = 0.5 ** (1 / HALF_LIFE)

    def observe(self, chain: list[int], committed: list[int]) -> None:
        for j, token in enumerate(chain[: len(committed)]):
            self.tries[j] = self.tries[j] * self.decay + 1
            self.hits[j] *= self.decay
            if token != committed[j]:
                break
            self.hits[j] += 1

    def values(self, length: int) -> list[float]:
        """P(the first j+1 chain tokens are all right), j < length (prior: 0.5 per position, weight 2)."""
        out, p = [], 1.0
        for j in range(length):
            p *= (self.hits[j] + 1.0) / (self.tries[j] + 2.0)
            out.append(p)
        return out


class StepTimes:
    """What a step of each size costs in this run: the calibrated curve's seconds times a factor per bucket, learned
    from the decode loop's own clock.

    The curve is measured once, in a tight loop; the steps it prices run later, amid the loop's own work, on a machine
    whose speed drifts (this CPU's plain step ranges over 11-16 ms as its neighbours' load changes, and the relative
    cost of 8 tokens over 1.2-1.55 with it). Each step's measured seconds over the curve's prediction for its size
    update its bucket's factor (a decayed mean; single outliers, a preemption say, are clipped to 2x). A bucket not
    stepped yet borrows the factor of the nearest one that was (the bigger one on a tie), so a curve that drifted up
    makes the unexplored sizes look dearer too, and one that drifted down gets them tried."""

    RECENT = 32  # the factor is a mean over about this many recent steps of its bucket

    def __init__(self, model: CostModel):
        self.model = model
        self.factor: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def observe(self, tokens: int, prefix: int, seconds: float) -> None:
        buckets = self.model.buckets
        predicted = self.model.seconds(tokens, prefix) if tokens <= buckets[-1] else 0.0
        if predicted <= 0.0:  # a curve without timings (a cache too small to measure in) has nothing to correct
            return
        T = next(b for b in buckets if b >= tokens)  # the bucket the step was charged as
        r, f, n = seconds / predicted, self.factor.get(T), self.count.get(T, 0)
        if f is not None:
            r = min(max(r, f / 2), f * 2)
        self.factor[T] = r if f is None else f + max(1 / (n + 1), 1 / self.RECENT) * (r - f)
        self.count[T] = n + 1

    def curve(self, prefix: int) -> dict[int, float]:
        """The estimated cost of a step of each bucket size after `prefix` cached tokens, in the calibration's plain
        steps (the calibrated curve, corrected)."""
        buckets, seen = self.model.buckets, sorted(self.factor)
        out = {}
        for i, T in enumerate(buckets):
            near = min(seen, key=lambda b: (abs(buckets.index(b) - i), -b)) if seen else None
            out[T] = self.model.cost(T, prefix) * (self.factor[near] if near is not None else 1.0)
        return out


class AdaptiveTrees:
    """The best tree for each size, from RankStats, re-ranked every `refresh` observations; the size from the cost
    (the engine sets `cost`, the calibrated curve; StepTimes corrects it online)."""

    def __init__(self, k: int, cost: CostModel | None, max_tokens: int = 128, refresh: int = 8, device="cpu"):
        self.stats, self.refresh, self.device = RankStats(k), refresh, device
        self.cost = cost
        self.buckets = tuple(T for T in BUCKETS if T <= max_tokens)
        self.max_step_tokens = self.buckets[-1]
        self._since = refresh  # rank on first use
        self._trees: dict[tuple, DraftTree] = {}

    @property
    def cost(self) -> CostModel | None:
        return self._cost

    @cost.setter
    def cost(self, cost: CostModel | None) -> None:
        if cost is not getattr(self, "_cost", None):  # a new curve (a first one, a recalibration): learn afresh
            self._cost = cost
            self.times = StepTimes(cost) if cost is not None else None

    def observe(self, rows: list[list[int]], targets: list[int]) -> None:
        self.stats.observe(rows, targets)
        self._since += 1

    def observe_step(self, tokens: int, prefix: int, seconds: float) -> None:
        """A verify of `tokens` tokens after `prefix` took `seconds`, drafting to compaction."""
        self.times.observe(tokens, prefix, seconds)

    def _rank(self) -> None:
        """Best-first expansion: the nodes with the highest path probabilities, in order."""
        rates, k, depth = self.stats.rates(), self.stats.k, self.stats.max_depth
        heap = [(-rates[0][r], (r,)) for r in range(k)]
        heapq.heapify(heap)
        paths, probs = [], []
        while heap and len(paths) < self.max_step_tokens - 1:
            neg, path = heapq.heappop(heap)
            paths.append(path)
            probs.append(-neg)
            if len(path) < depth:
                for r in range(k):
                    heapq.heappush(heap, (neg * rates[len(path)][r], path + (r,)))
        self.paths, self.cum = paths, [0.0] + list(accumulate(probs))
        self._since = 0

    def choose(self, prefix: int, chain: list[float] = ()) -> tuple[int, int]:
        """(tree tokens, chain tokens) maximising expected committed tokens / verify cost; `chain` holds the path
        probabilities of an available prompt-lookup chain's tokens. A tree's size is a bucket; a chain on top is
        charged the cost of the next bucket up."""
        if self._since >= self.refresh:
            self._rank()
        curve = self.times.curve(prefix)
        buckets = [T for T in self.buckets if T in curve]  # a curve measured in a small cache stops early
        charged = {}  # tokens -> cost of the smallest bucket holding them
        for T in range(buckets[-1], 0, -1):
            charged[T] = curve[T] if T in curve else charged[T + 1]
        chain_cum = [0.0] + list(accumulate(chain))
        best, best_value = (1, 0), 1.0 / charged[1]
        for T in buckets:
            tree_value = 1.0 + self.cum[min(T - 1, len(self.cum) - 1)]
            for m in range(0, min(len(chain), buckets[-1] - T) + 1):
                value = (tree_value + chain_cum[m]) / charged[T + m]
                if value > best_value:
                    best, best_value = (T, m), value
        return best

    def tree(self, tokens: int) -> DraftTree:
        """The current best tree of `tokens` tokens (root included)."""
        paths = tuple(self.paths[: tokens - 1])
        tree = self._trees.get(paths)
        if tree is None:
            if len(self._trees) > 256:
                self._trees.clear()
            tree = self._trees[paths] = build_tree(paths).to(self.device)
        return tree
