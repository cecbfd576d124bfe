"""Speculative decoding, the paper's algorithm box: retrieve -> verify -> accept -> (compact) -> recycle.

Lossless by construction: a drafted token is kept only if it equals the model's own greedy choice at its parent, and
every step also commits the model's next token after the last kept one, so the output is exactly plain greedy
decoding's (tests/test_speculative.py holds it to that). With sampling, the choice at each node is the model's
sample there instead of its argmax (accept_sampled; tr_engine/core/sampling.py says why that is exactly the model's
distribution, and tests/test_sampling.py tests it).

Cache invariant: slots 0..L-1 hold every committed token but the last one (the root of the next step).

Read token_recycling_reference first: the whole algorithm in one function (the paper's static tree, greedy), with
the matrix, the model and the ops called directly. `step` below is the same algorithm as the engine runs it: one
forward for one sequence or many, for every drafter (the adaptive tree, prompt lookup, hybrid; none: a plain step),
greedy or sampled, under tensor parallelism, timed by phase. The decode driver (tr_engine/core/batch.py: admit, step,
stop, retire) runs it for one sequence (speculative_steps, with streaming and exact stopping) or many;
tests/test_speculative.py holds the reference and the loop to the same tokens.
"""

import time

import torch

from tr_engine.core.decode import prefill
from tr_engine.core.drafters import Draft
from tr_engine.core.sampling import Sampler, greedy
from tr_engine.core.tree import DraftTree, chain_tree
from tr_engine.model.kv_cache import KVCache
from tr_engine.model.llama import Llama


@torch.inference_mode()
def token_recycling_reference(model: Llama, cache: KVCache, prompt_ids: list[int], matrix, tree, max_new_tokens: int,
                              eos_ids: tuple[int, ...], ops) -> list[int]:
    """Token Recycling, greedy, with a static tree: the paper's algorithm box and nothing else. `matrix` is a
    RecyclingMatrix (kept across calls: hot start), `tree` a DraftTree on the cache's device, `ops` the op namespace
    (tr_engine.model.ops). Returns the new ids."""
    cache.check_room(len(prompt_ids) + max_new_tokens + tree.size)  # (no cutting the tree near the cache's end)
    out = [int(prefill(model, cache, prompt_ids).argmax())]  # the prompt's K/V cached; the first token
    while len(out) < max_new_tokens and not any(t in eos_ids for t in out):
        L = cache.length  # the root (the last token) goes to slot L, node i to slot L + i
        # retrieve: the tree's tokens from the matrix, breadth-first from the root: node (.., r) = rank r of its parent
        tokens = matrix.retrieve(torch.tensor(out[-1], device=cache.data.device), tree)  # [n+1], the root first
        # verify: one forward over every node, each attending to the cache and to its ancestors
        logits = model(tokens, L + tree.depth, cache.data, L, tree_mask=tree.mask)  # [n+1, V]
        # accept: from the root, descend to the child that holds the model's own choice, while there is one; then
        # the model's choice at the last accepted node (the bonus token)
        predicted, drafted = logits.argmax(dim=-1).tolist(), tokens.tolist()
        path, node = [], 0
        while (child := next((c for c in tree.children[node] if drafted[c] == predicted[node]), None)) is not None:
            path.append(child)
            node = child
        # compact: the accepted nodes' K/V move next to the root's; the rest of the tree is forgotten
        if path:
            ops.compact_kv_(cache.data, torch.tensor([L + i for i in path], device=cache.data.device), L + 1)
        cache.length = L + 1 + len(path)
        # recycle: every node's top-k candidates become its token's row of the matrix (the last node wins)
        matrix.recycle_(tokens, logits)
        out += [drafted[i] for i in path] + [predicted[node]]
    stop = next((i + 1 for i, t in enumerate(out) if t in eos_ids), len(out))  # nothing after an EOS
    return out[: min(stop, max_new_tokens)]


def verify(model: Llama, cache: KVCache, draft: Draft, gather: bool = True) -> torch.Tensor:
    """One forward over the root and all draft nodes with tree attention; positions = L + depth.
    Their K/V land in slots L..L+n. Returns logits [n+1, V] (this rank's columns alone under tensor parallelism
    without `gather`)."""
    L = cache.length
    positions = L + draft.tree.depth  # [n+1]
    return model(draft.tokens, positions, cache.data, L, tree_mask=draft.tree.mask if draft.tree.size > 1 else None,
                 gather=gather)


def accept(draft: Draft, predicted: torch.Tensor) -> tuple[list[int], list[int]]:
    """Greedy acceptance, given the model's choice at every node (predicted [n+1]: the argmax of its logits): from
    the root, descend to the child whose token equals the choice at the current node, while one exists (ties between
    identical siblings go to the lower rank). Returns the accepted node indices and the committed tokens: the
    accepted drafts plus the bonus token (the choice at the last accepted node)."""
    predicted, tokens = torch.stack([predicted, draft.tokens]).tolist()  # the step's one host sync
    path, node = [], 0
    while True:
        child = draft.tree.child(node, tokens, predicted[node])
        if child is None:
            break
        path.append(child)
        node = child
    return path, [tokens[i] for i in path] + [predicted[node]]


def accept_sampled(draft: Draft, logits: torch.Tensor, sampler: Sampler, j: int) -> tuple[list[int], list[int]]:
    """Sampled acceptance, for the step whose first new token is the generation's j-th: from the root, draw the
    node's sample (the (j + depth)-th) and descend to the child drafted with it, while there is one; the last sample,
    which no child drafted, is the bonus token. One sample per node on the path, shared by every branch below it."""
    tokens = draft.tokens.tolist()
    path, node = [], 0
    while True:
        x = sampler.draw(logits[node], j + len(path))
        child = draft.tree.child(node, tokens, x)
        if child is None:
            return path, [tokens[i] for i in path] + [x]
        path.append(child)
        node = child


def fits(draft: Draft, cache: KVCache) -> Draft:
    """The draft, or its first tokens when the whole tree would run past the cache's end (a verify step writes its
    tokens' K/V after the committed ones before compaction). While decoding, at least the root and one node fit."""
    return draft.cut(cache.capacity - cache.length)


def compact(cache: KVCache, path: list[int], ops) -> None:
    """Keep the root's and the accepted nodes' K/V, contiguous after the prefix; the rest of the tree is dropped."""
    L = cache.length
    if path:  # the root stays at slot L; accepted node i moves from slot L+i (the kernel skips slots already in place)
        src = torch.tensor([L + i for i in path], device=cache.data.device)
        ops.compact_kv_(cache.data, src, L + 1)
    cache.length = L + 1 + len(path)


PHASES = ("retrieve", "verify", "accept", "compact", "recycle")


class PhaseClock:
    """Seconds per phase of the loop, summed over its steps. On a GPU these host clocks see launches only, except
    accept's, whose host sync absorbs the wait for the verify."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def start(self) -> None:
        self.step_start = self.last = time.perf_counter()

    def lap(self, phase: str) -> float:
        """End `phase` now; returns the seconds since the step started."""
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now
        return now - self.step_start


_ROOT_ALONE: dict[torch.device, DraftTree] = {}  # device -> the one-node tree of a plain step


def retrieve(drafter, histories: list[list[int]], caches: list[KVCache], limits: list[int | None] | None = None
             ) -> list[Draft]:
    """Each sequence's draft for this step, cut to the room its cache has left (fits) and to its limit, if it has one
    (`limits[i]`: the most tokens its verify may take, the root included): from the drafter (planned together for
    several sequences where it can: one forward's budget split among them), or with no drafter the root alone (a
    plain step)."""
    if drafter is None:
        device = caches[0].data.device
        tree = _ROOT_ALONE.get(device)
        if tree is None:
            tree = _ROOT_ALONE[device] = chain_tree(0).to(device)
        drafts = [Draft(tree, torch.tensor([h[-1]], device=device), h[-1], len(h)) for h in histories]
    elif len(histories) > 1 and hasattr(drafter, "propose_batch"):
        drafts = drafter.propose_batch(histories)
    else:
        drafts = [drafter.propose(h) for h in histories]
    drafts = [fits(d, c) for d, c in zip(drafts, caches)]
    return drafts if limits is None else [d if n is None else d.cut(n) for d, n in zip(drafts, limits)]


@torch.inference_mode()
def step(model: Llama, caches: list[KVCache], histories: list[list[int]], drafter, ops,
         samplers: list[Sampler | None], done: list[int], verify_many=None, clock: PhaseClock | None = None,
         limits: list[int | None] | None = None) -> tuple[list[Draft], list[tuple[list[int], list[int]]]]:
    """One forward for one sequence or many: retrieve -> verify -> accept -> compact -> learn -> recycle.

    Sequence i has its own cache (`caches[i]`, holding all of `histories[i]` but its last token, the root), its
    sampler (None: greedy) and `done[i]` tokens generated before this step (its sampled draws' index). Several
    sequences are verified by `verify_many(drafts)`, one ragged forward over their caches (tr_engine/core/batch.py).
    `limits[i]`, if given, caps sequence i's verify tokens (retrieve).
    Returns each sequence's draft and what it accepted: the accepted nodes and the tokens it commits (those nodes'
    and the bonus token; before stop rules: `stop`)."""
    clock = clock or PhaseClock()
    clock.start()
    drafts = retrieve(drafter, histories, caches, limits)
    drafted = clock.lap("retrieve")
    logits, rows, top = verify_all(model, caches, drafts, drafter, samplers, verify_many)
    clock.lap("verify")
    accepted = [accept(d, top[1][:, 0]) if top is not None
                else accept(d, greedy(lg, ops)) if sampler is None
                else accept_sampled(d, lg, sampler, j)
                for d, lg, sampler, j in zip(drafts, rows, samplers, done)]
    clock.lap("accept")
    for cache, (path, _) in zip(caches, accepted):
        compact(cache, path, ops)
    seconds = clock.lap("compact")  # drafting to compaction: what the adaptive tree prices
    if drafter is not None:
        learn(drafter, drafts, accepted, seconds, drafted)
        recycle(drafter, drafts, logits, rows, top)
    ended = clock.lap("recycle")
    adaptive = getattr(drafter, "adaptive", None)
    if len(drafts) > 1 and adaptive is not None:  # the drafter's own host work, which a plain step does without
        adaptive.observe_host(len(drafts), drafted + ended - seconds)
    return drafts, accepted


def verify_all(model: Llama, caches: list[KVCache], drafts: list[Draft], drafter, samplers, verify_many):
    """Every draft's logits, one forward: all of them [sum of n_i + 1, V], each sequence's rows, and None; or, for
    one greedy sequence under tensor parallelism, None, [None] and the merged top-k (values, ids) [n + 1, k] of its
    rows over the whole vocabulary, all a greedy step needs (the first for acceptance, all k for recycling), not the
    logits gathered."""
    if len(drafts) > 1:
        logits = verify_many(drafts)
        return logits, logits.split([d.tree.size for d in drafts]), None
    if drafter is not None and samplers[0] is None and model.shard.world > 1 and hasattr(drafter, "recycle_top"):
        return None, [None], model.top_k(verify(model, caches[0], drafts[0], gather=False), drafter.top_k)
    logits = verify(model, caches[0], drafts[0])
    return logits, [logits], None


def learn(drafter, drafts: list[Draft], accepted, seconds: float, drafted: float = 0.0) -> None:
    """The drafter's statistics from what each sequence accepted; the adaptive tree's step times: alone, the step's
    `seconds` (drafting to compaction); in a batch, the whole forward's tokens at the batch's mean prefix (what
    AdaptiveTrees.plan prices), less the `drafted` seconds of drafting, which the plan counts apart (observe_host)."""
    one = len(drafts) == 1
    for d, (_, tokens) in zip(drafts, accepted):
        drafter.learn(d, tokens, seconds if one else 0.0)
    adaptive = getattr(drafter, "adaptive", None)
    if not one and adaptive is not None:
        adaptive.observe_step(sum(d.tree.size for d in drafts), sum(d.prefix for d in drafts) // len(drafts),
                              seconds - drafted)


def recycle(drafter, drafts: list[Draft], logits, rows, top) -> None:
    """Every node's top-k into the matrix: from the merged top-k (tensor parallelism), or from the logits, a batch's
    in sequence order, each breadth-first (the last writer wins)."""
    if top is not None:
        drafter.recycle_top(drafts[0], *top)
    elif len(drafts) > 1 and hasattr(drafter, "recycle_batch"):
        drafter.recycle_batch(drafts, logits)
    else:
        for d, lg in zip(drafts, rows):
            drafter.recycle(d, lg)


def prefill_and_seed(model: Llama, cache: KVCache, ids: list[int], seed_matrix=None) -> torch.Tensor:
    """Prefill `ids`; with `seed_matrix(ids, logits)`, hand it every position's logits (the matrix's prompt seeding).
    Returns the last position's logits [V]."""
    if seed_matrix is None:
        return prefill(model, cache, ids)
    logits = prefill(model, cache, ids, all_logits=True)  # [T, V]
    seed_matrix(ids, logits)
    return logits[-1]


def stop(committed: list[int], done: int, max_new_tokens: int, eos_ids: tuple[int, ...]) -> tuple[list[int], bool]:
    """Exact stopping: a step's committed tokens cut after an EOS and at max_new_tokens (`done` already out), and
    whether the generation ends with them."""
    committed = committed[: max_new_tokens - done]
    eos_at = next((i for i, t in enumerate(committed) if t in eos_ids), None)
    if eos_at is not None:
        committed = committed[: eos_at + 1]
    return committed, eos_at is not None or done + len(committed) >= max_new_tokens
