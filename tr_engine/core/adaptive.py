"""Cost-aware adaptive draft trees: each step verifies the tree with the most expected accepted tokens per unit of
verify cost on this machine.

The paper expands a fixed 80-node tree. Which tree pays depends on two things it does not look at:
- how likely each candidate is to be right. The matrix keeps, beside each row's ids, their confidence when the row
  was written (the softmax of the row's top-k logits). The model gave it in another context, so `ConfidenceStats`
  learns online how often a candidate of each confidence (in bins) is right, by depth: every committed token is one
  observation for every candidate of its predecessor's row, whatever tree was verified.
- what verifying T tokens costs (tr_engine/core/cost.py: measured on this machine, in plain steps), corrected online by
  `StepTimes` from the decode loop's own clock.

A node is taken to be accepted with the product of its path's rates, so the expected tokens a step commits are 1
(the bonus token) plus the sum of its nodes' probabilities, and the best tree of n nodes is the n most probable nodes
(a child's probability is never above its parent's, so they form a tree). Each step, `AdaptiveTrees.plan` expands the
roots' candidates best first, reading the matrix as it goes (EAGLE-2's dynamic tree, with the recycling matrix as
the drafter), and stops at the size that maximises expected tokens / cost(size), which may be a plain one-token
step when nothing pays. One sequence or a batch is the same plan: a batched step's sequences share one forward, so
their candidates compete for its tokens.

Candidates from outside the matrix (hybrid drafting: prompt lookup's chain, whose j-th token is right with the
product of the first j per-position rates that `ChainStats` learns, and the suffix index's continuations) enter the
same sum as a trie under the root (`Candidates`): a candidate that follows the tree's own nodes is the same node (no
cost, no extra token), and the others compete with the tree's nodes for the step's size.
"""

import heapq
from bisect import bisect_right
from dataclasses import dataclass, field

from tr_engine.core.cost import BUCKETS, CostModel
from tr_engine.core.tree import DraftTree, TreeCache, build_tree, trie_children
from tr_engine.model.parallel import ALONE, Shard

# A candidate's confidence (its share of its row's top-k mass when the row was written: RecyclingMatrix.confidence)
# falls in one of these bins; each bin's acceptance rate is learned, per depth class.
EDGES = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
DEPTHS = 3  # depth classes: the first draft position below the root, the second, and deeper
PRIOR_WEIGHT = 4.0  # before any observation a bin's rate is half its confidence, worth this many observations
HALF_LIFE = 512  # observations; older ones fade, so the tree follows the text it is drafting
# The matrix's candidates are right more often where another source has candidates too (prompt lookup found a match,
# the suffix index knows the text: copied or repeated text, which the matrix drafts well also) than where it drafts
# alone. Learned together, the rates were an average of the two: on SmolLM2 bf16 (12 dev questions, hybrid), where
# lookup found nothing a depth-1 node was priced 0.21 and right 0.12 of the time (depth 2: 0.13 and 0.05), where it
# found something 0.34 and 0.35. So they are learned apart, by the context a step drafted in (Draft.context).
CONTEXTS = ("matrix alone", "beside other sources")


def confidence_bin(c: float) -> int:
    return bisect_right(EDGES, c)


class ConfidenceStats:
    """Decayed counts of 'the greedy next token was the candidate of confidence bin b in the previous token's matrix
    row', by depth class: how often a candidate of a given confidence is right, learned online (the matrix's
    confidences are the model's, but from another context: calibrated here, in use). `classes`: how many classes
    the rows fall in (by default the DEPTHS depth classes; a caller that classes its rows otherwise says which class
    each row is in when it observes them)."""

    def __init__(self, classes: int = DEPTHS):
        bins = len(EDGES) + 1
        self.hits = [[0.0] * bins for _ in range(classes)]
        self.tries = [[0.0] * bins for _ in range(classes)]
        self.decay = 0.5 ** (1 / HALF_LIFE)
        mids = [(lo + hi) / 2 for lo, hi in zip((0.0,) + EDGES, EDGES + (1.0,))]
        self.prior = [m / 2 for m in mids]

    def observe(self, rows: list[list[int]], confidences: list[list[float]], targets: list[int],
                classes: list[int] | None = None) -> None:
        """rows[d], confidences[d]: the matrix row (before this step's recycle) of the token at depth d of the
        committed path (the root first); targets[d]: the greedy token that followed it; classes[d]: the row's class
        (default: its depth class). Every candidate of the row is an observation of its bin: right if it is the first
        one holding the target (the one accept would take)."""
        for d, (row, conf, target) in enumerate(zip(rows, confidences, targets)):
            k = min(d, DEPTHS - 1) if classes is None else classes[d]
            hits, tries = self.hits[k], self.tries[k]
            right = row.index(target) if target in row else -1
            for r, c in enumerate(conf):
                b = confidence_bin(c)
                tries[b] = tries[b] * self.decay + 1
                hits[b] = hits[b] * self.decay + (r == right)

    def rates(self) -> list[list[float]]:
        """rates[d][b]: estimated P(a candidate of bin b is right | the path reached a row of class d)."""
        return [[(h + PRIOR_WEIGHT * p) / (t + PRIOR_WEIGHT) for h, t, p in zip(hits, tries, self.prior)]
                for hits, tries in zip(self.hits, self.tries)]


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


@dataclass
class Candidates:
    """One sequence's draft candidates from outside the matrix: a trie under the root (node 0, the last committed
    token; each parent before its children), `value[i]` the estimated probability that node i's whole path is right
    (never above its parent's), `source[i]` the bits of the sources that proposed it (tr_engine/core/drafters.py's
    LOOKUP, SUFFIX; 0 for the root)."""

    parent: list[int]
    token: list[int]
    value: list[float]
    source: list[int] = field(default_factory=list)

    @classmethod
    def chain(cls, root: int, tokens: list[int], values: list[float], source: int = 0) -> "Candidates":
        """A chain of `tokens` under `root`, its j-th token's whole path right with `values[j]`."""
        return cls([0] + list(range(len(tokens))), [root] + list(tokens), [1.0] + list(values),
                   [0] + [source] * len(tokens))

    def merged(self, other: "Candidates") -> "Candidates":
        """Both tries in one: a path in both is one node, worth the larger of its two values, proposed by both."""
        parent, token, value, source = list(self.parent), list(self.token), list(self.value), list(self.source)
        kids = self.children()
        where = [0] * len(other.parent)
        for i in range(1, len(other.parent)):
            up = where[other.parent[i]]
            node = kids[up].get(other.token[i])
            if node is None:
                node = kids[up][other.token[i]] = len(parent)
                parent.append(up)
                token.append(other.token[i])
                value.append(0.0)
                source.append(0)
                kids.append({})
            value[node] = max(value[node], other.value[i])
            source[node] |= other.source[i]
            where[i] = node
        for i in range(1, len(parent)):  # (a child is never worth more than its parent)
            value[i] = min(value[i], value[parent[i]])
        return Candidates(parent, token, value, source)

    def children(self) -> list[dict[int, int]]:
        """Per node, its children by token."""
        return trie_children(self.parent, self.token)


NO_CANDIDATES = Candidates([0], [0], [1.0], [0])


def context_of(extra: Candidates) -> int:
    """The context a step drafts in (an index into CONTEXTS): 1 where another source offered candidates."""
    return int(len(extra.parent) > 1)


class StepTimes:
    """What a step of each size costs in this run: the calibrated curve's seconds times a factor per bucket, learned
    from the decode loop's own clock.

    The curve is measured once, in a tight loop; the steps it prices run later, amid the loop's own work, on a machine
    whose speed drifts (a shared CPU's plain step, and the relative cost of a bigger verify with it, move as its
    neighbours' load changes: bench/results/forward_cost_*.md shows the spread). Each step's measured seconds over
    the curve's prediction for its size update its bucket's factor (a decayed mean; single outliers, a preemption say,
    are clipped to 2x). A bucket not stepped yet borrows the factor of the nearest one that was (the bigger one on a
    tie), so a curve that drifted up makes the unexplored sizes look dearer too, and one that drifted down gets them
    tried.

    Two guards keep one noisy step from pricing a size out for good (a size priced out is never stepped again, so its
    factor is never corrected): a bucket's first step starts from the factor it borrowed, counted as PRIOR steps, so
    that step moves it a quarter of the way, not all of it; and the corrected curve never has a size cost more than a
    bigger one (a verify of more tokens does all the work of fewer). Before them, a bucket's first step set its
    factor whole: in one Spec-Bench run (amx, bf16) sizes 2, 3, 5 and 6 each got one slow first step (1.11-1.26x),
    were priced above size 4 from then on, and every one of 6372 steps verified 1 or 4 tokens."""

    RECENT = 32  # the factor is a mean over about this many recent steps of its bucket
    PRIOR = 3  # the steps a bucket's borrowed factor counts for at its first step of its own

    def __init__(self, model: CostModel):
        self.model = model
        self.factor: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self._nearest: list[int | None] | None = None  # per bucket, the stepped bucket whose factor it takes

    def observe(self, tokens: int, prefix: int, seconds: float) -> None:
        buckets = self.model.buckets
        predicted = self.model.seconds(tokens, prefix) if tokens <= buckets[-1] else 0.0
        if predicted <= 0.0:  # a curve without timings (a cache too small to measure in) has nothing to correct
            return
        T = next(b for b in buckets if b >= tokens)  # the bucket the step was charged as
        f, n = self.factor.get(T), self.count.get(T, 0)
        if f is None:  # its first step: from the factor it borrowed until now (1.0 while none was stepped)
            near = self._borrowed()[buckets.index(T)]
            f, n = (self.factor[near] if near is not None else 1.0), self.PRIOR
            self._nearest = None  # (the others may borrow from it now)
        r = min(max(seconds / predicted, f / 2), f * 2)
        self.factor[T] = f + max(1 / (n + 1), 1 / self.RECENT) * (r - f)
        self.count[T] = n + 1

    def _borrowed(self) -> list[int | None]:
        """Per bucket, the stepped bucket whose factor it takes: its own, else the nearest (the bigger on a tie)."""
        if self._nearest is None:  # (each plan asks: worked out again only when a bucket is stepped first)
            seen = [(i, T) for i, T in enumerate(self.model.buckets) if T in self.factor]
            self._nearest = [min(seen, key=lambda s: (abs(s[0] - i), -s[0]))[1] if seen else None
                             for i in range(len(self.model.buckets))]
        return self._nearest

    def curve(self, prefix: int) -> dict[int, float]:
        """The estimated cost of a step of each bucket size after `prefix` cached tokens, in the calibration's plain
        steps (the calibrated curve, corrected; no size dearer than a bigger one)."""
        buckets = self.model.buckets
        cost = [c * (self.factor[near] if near is not None else 1.0)
                for c, near in zip(self.model.curve(prefix), self._borrowed())]
        for i in range(len(cost) - 2, -1, -1):
            cost[i] = min(cost[i], cost[i + 1])
        return dict(zip(buckets, cost))


class AdaptiveTrees:
    """Each step's tree: the root's most probable continuations in the matrix, as many as pay for their cost. The
    engine sets `cost` (the calibrated curve); StepTimes corrects it online; ConfidenceStats turns the matrix's
    confidences into acceptance rates, refreshed every `refresh` observations."""

    MAX_DEPTH = 12
    # A batched step drafts only if it expects to beat plain decoding by this much: at a large batch the gain is a few
    # percent at best, within the error of the estimates, while a wrong guess costs the whole batch's step
    # (bench/results/batch.md: at batch 16, drafting on a bare expected gain lost a few percent to plain decoding).
    BATCH_MARGIN = 0.05
    # A batch whose plan drafts nothing decodes plainly (no drafter at all: neither its retrieve nor its recycle) for
    # this many steps, then plans again (tr_engine/core/batch.py); sooner when the batch shrinks.
    PLAIN_STEPS = 8

    def __init__(self, cost: CostModel | None, max_tokens: int = 128, refresh: int = 8, device="cpu",
                 pinned: bool = False, shard: Shard = ALONE):
        self.stats = [ConfidenceStats() for _ in CONTEXTS]  # (by context: CONTEXTS)
        self.refresh, self.device = refresh, device
        self.shard = shard  # under tensor parallelism every rank must plan the same trees: step times are agreed
        self._cost, self.times = None, None  # (none yet: the engine sets its curve at the first decode)
        self.cost = cost
        self.pinned = pinned  # the cost curve stays the one given: the engine does not set it, steps do not correct it
        self.buckets = tuple(T for T in BUCKETS if T <= max_tokens)
        self.max_step_tokens = self.buckets[-1]
        self._since = refresh  # rates on first use
        self._trees = TreeCache(1024)  # the trees planned lately, by their rank paths
        self.host_s = 0.0  # the drafter's host seconds a sequence of a batched step (retrieve, learn, recycle): a mean
        self._host_n = 0
        self.tokens: list[list[int]] = []  # the last plan's trees' tokens, and the rows it read (plan)
        self.rows: dict[int, tuple[list[int], list[float]]] = {}

    @property
    def cost(self) -> CostModel | None:
        return self._cost

    @cost.setter
    def cost(self, cost: CostModel | None) -> None:
        if cost is not self._cost:  # a new curve (a first one, a recalibration): learn afresh
            self._cost = cost
            self.times = StepTimes(cost) if cost is not None else None

    def observe(self, rows: list[list[int]], confidences: list[list[float]], targets: list[int],
                context: int = 0) -> None:
        """A step's committed path in the matrix rows that drafted it (ConfidenceStats.observe), in the `context` the
        step drafted in (an index into CONTEXTS: 1 where another source offered candidates)."""
        self.stats[context].observe(rows, confidences, targets)
        self._since += 1

    def observe_step(self, tokens: int, prefix: int, seconds: float) -> None:
        """A verify of `tokens` tokens after `prefix` took `seconds`, drafting to compaction."""
        if not self.pinned:
            self.times.observe(tokens, prefix, self.shard.agree(seconds))

    def observe_host(self, sequences: int, seconds: float) -> None:
        """A batched step of `sequences` spent `seconds` on the drafter's own host work: drafting (planning included),
        learning and recycling, what a plain step does not do. Kept as a decayed mean a sequence, which `plan` adds to
        a drafted batch's cost."""
        if self.pinned:
            return
        per, n = self.shard.agree(seconds) / sequences, self._host_n
        self.host_s += max(1 / (n + 1), 1 / StepTimes.RECENT) * (per - self.host_s)
        self._host_n = n + 1

    def plan(self, table, confidence, roots: list[int], prefixes: list[int],
             extras: list[Candidates] | None = None) -> list[tuple[DraftTree, list[int]]]:
        """One step's trees, one per sequence (one or many), and which of its candidates from outside the matrix
        (`extras`, a trie each: Candidates) each adds, maximising the step's expected committed tokens over the cost
        of one forward of all their tokens. `table`, `confidence`: the matrix's [V, k] ids and confidences. Returns
        (tree, the chosen extra nodes in index order: parents first) per sequence.

        Best-first expansion: a node's probability is its parent's times the rate of its confidence bin at its
        depth, so the n most probable nodes form a tree (a child is never above its parent), and a sequence's
        expected tokens are 1 (the bonus token) plus its nodes' probabilities. Every sequence's candidates (its
        tree's nodes and its extra ones) come off one heap, most probable first across the batch, so each sequence
        drafts what its candidates are worth against the others'. An extra candidate the tree drafts too (the same
        token under the same path) is one node: the second of the two adds neither a token nor a probability. The
        cost of n tokens is the curve's at the batch's mean prefix and the smallest measured size holding them: a
        step runs padded to that size under CUDA graphs, and on a CPU the kernels' cost moves in steps of their row
        tiles (bench/results/forward_cost_*.md), which a line between two sizes would underprice. Candidates are
        taken while a bigger step could still beat the best so far. A batch of more than one drafts only if its best
        plan beats plain decoding by BATCH_MARGIN, its cost counting the drafter's own host work (observe_host), which
        the plain step it is compared with does without.

        What the plan read stays for the step's other host work, which runs before the matrix changes (the recycle
        ends the step): `self.tokens`, each tree's tokens (root first, in the tree's order: what matrix.retrieve would
        gather), and `self.rows`, the rows it read by token (what learning reads back for the committed path)."""
        if self._since >= self.refresh:
            self._rates, self._since = [stats.rates() for stats in self.stats], 0
        B = len(roots)
        extras = extras or [NO_CANDIDATES] * B
        rates = [self._rates[context_of(x)] for x in extras]  # per sequence: its context's rates
        kids = [x.children() for x in extras]
        prefix = sum(prefixes) // B
        curve = self.times.curve(prefix)
        sizes = [T for T in self.buckets if T in curve]  # a curve measured in a small cache stops early

        def cost(n: int) -> float:  # the smallest measured size holding n tokens (past the largest: in proportion)
            T = next((T for T in sizes if T >= n), None)
            return curve[T] if T is not None else curve[sizes[-1]] * n / sizes[-1]

        heap = []  # (-probability, sequence, tie-breaker, node): a tree node (path, token) or an extra node's index

        # The rows through numpy views: a tensor's row index and tolist cost ~10x a numpy array's, dozens a step, each
        # right after a forward has flushed the caches. (A CPU tensor: the matrix itself, or on a GPU its host mirror.)
        ids, confidences = table.numpy(), confidence.numpy()
        self.rows = rows = {}  # token -> its row's (ids, confidences) as read here (each token's row read once)

        def expand(b: int, token: int, path: tuple, p: float) -> None:
            d = min(len(path), DEPTHS - 1)
            row = rows.get(token)
            if row is None:
                row = rows[token] = (ids[token].tolist(), confidences[token].tolist())
            for r, (child, c) in enumerate(zip(*row)):
                heapq.heappush(heap, (-p * rates[b][d][confidence_bin(c)], b, len(heap), (path + (r,), child)))

        def offer(b: int, node: int) -> None:
            for child in kids[b][node].values():
                heapq.heappush(heap, (-extras[b].value[child], b, len(heap), child))

        for b, root in enumerate(roots):
            expand(b, root, (), 1.0)
            offer(b, 0)
        # The pairs of one node drafted by both sources: extra node <-> tree path (the roots: 0 <-> ()); and what
        # each source took so far.
        path_of, extra_of = [{0: ()} for _ in roots], [{(): 0} for _ in roots]
        taken_extra, taken_tree = [set() for _ in roots], [{} for _ in roots]  # {(parent path, token): path}
        taken, total, expected = [], B, float(B)
        margin, host = 0.0, 0.0  # (one sequence alone: its step seconds, drafting included, price its trees)
        if B > 1:
            plain_s = self.times.model.seconds(1, prefix)
            margin, host = self.BATCH_MARGIN, B * self.host_s / plain_s if plain_s > 0 else 0.0
        best, best_value, self.expected = 0, B / cost(B) * (1 + margin), float(B)
        while heap and total < sizes[-1]:
            neg, b, _, node = heapq.heappop(heap)
            taken.append((b, node))
            if isinstance(node, int):  # an extra node: its children become candidates
                offer(b, node)
                up = path_of[b].get(extras[b].parent[node])
                path = None if up is None else taken_tree[b].get((up, extras[b].token[node]))
                twin = path is not None
                taken_extra[b].add(node)
            else:
                path, token = node
                taken_tree[b][(path[:-1], token)] = path
                up = extra_of[b].get(path[:-1])
                node = None if up is None else kids[b][up].get(token)
                twin = node is not None and node in taken_extra[b]
                if len(path) < self.MAX_DEPTH:
                    expand(b, token, path, -neg)
            if node is not None and path is not None:
                path_of[b][node], extra_of[b][path] = path, node
            if not twin:
                total, expected = total + 1, expected - neg
            if expected / (cost(total) + host) > best_value:
                best, best_value, self.expected = len(taken), expected / (cost(total) + host), expected
            top = -heap[0][0] if heap else 0.0  # no bigger step can win once even the best candidates cannot
            if all((expected + top * (U - total)) / (cost(U) + host) <= best_value for U in sizes if U > total):
                break
        paths, chosen, token_of = [[] for _ in roots], [[] for _ in roots], [{} for _ in roots]
        for b, node in taken[:best]:
            if isinstance(node, int):
                chosen[b].append(node)
            else:
                paths[b].append(node[0])
                token_of[b][node[0]] = node[1]
        trees = [self.tree(tuple(p)) for p in paths]
        self.tokens = [[root] + [tokens[p] for p in tree.paths] for root, tokens, tree in zip(roots, token_of, trees)]
        return [(tree, sorted(c)) for tree, c in zip(trees, chosen)]

    def tree(self, paths: tuple) -> DraftTree:
        """The tree of these rank paths (built once, kept while it recurs)."""
        return self._trees.get(paths, lambda: build_tree(paths).to(self.device))
