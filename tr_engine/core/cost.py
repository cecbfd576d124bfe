"""What a verify step costs on this machine, in plain decode steps, by the number of tokens it verifies.

A draft tree pays only if the tokens it gets accepted outweigh its cost, and that cost is a property of the hardware,
model, dtype and thread count: on the paper's A100 an 81-token verify costs little more than a plain step, on a small
CPU several (bench/results/forward_cost_*.md). So the adaptive tree (tr_engine/core/adaptive.py) reads a cost curve
measured where the engine runs: a few seconds of timed steps at first use, cached as JSON under $TR_ENGINE_HOME/costs/
per
model, dtype, device, threads and ops, and measured again when any of those (or the torch version, the CPU or the
compiled kernels) changes, or on `--recalibrate`.

A "step" here is what the decode loop pays per forward: the forward itself plus the argmax over its logits and the
host sync that reads them back. Each verify size is timed right after a plain step and priced by the ratio of the
two (the median over passes): a shared host's speed drifts by tens of percent within seconds, and curves priced by
medians a pass apart came out 1.17x and 1.58x at 8 tokens on one machine (the later with the faster kernels).

The measurement is bounded (MEASURE_BUDGET_S, under 20 s with a second try on a small model) and checked: sizes
dearer than MAX_RELATIVE plain steps are not timed (no tree that big can pay; their cost is extrapolated), and a curve
that is not monotone or was measured through a noisy spell (the plain step's own time moving by more than NOISE
from pass to pass, or other processes keeping busy CPUs its threads need: /proc/stat) is measured again once, and if
still doubtful used for this run only, never cached. A second try that times the same inversions alike, with no
spell (`reproduced`), is trusted: the matmul kernels change tiles with the row count, so a bigger verify can really
be cheaper than a smaller one (AVX2, float32, before the full tiles of 0acf380: 6 rows at 0.85x the time of 4), and
such a curve would be measured at every start.
"""

import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tr_engine.core.sampling import greedy
from tr_engine.core.tree import sample_tree_mask
from tr_engine.files import atomic_write
from tr_engine.model import cpu
from tr_engine.model.threads import CpuLoad

# Verify sizes (tokens, root included) a tree may take, and the ones the cost curve measures. Every size from 1 to 8
# is measured: where the matmul kernels change with the row count (tr_engine/model/ops.py), the curve has steps that
# interpolation would miss. A fixed set of sizes also keeps the verify shapes static (CUDA graphs).
BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)
PREFIXES = (256, 1024)  # cached tokens before the step (less in a small cache); the cost is linear between them
# A verify costing more than this many plain steps is not timed: the deepest trees accept ~8 tokens a step at best,
# so no tree that dear can pay. Its cost is extrapolated in proportion to its tokens (a compute-bound verify's).
MAX_RELATIVE = 12.0
NOISE = 1.3  # the plain step's slowest timing over its fastest, in one measurement, past which it was a noisy spell
MONOTONE = 1.15  # a size may time up to this much under a smaller one (noise); more, and the curve is not trusted
# ... unless a second try times it alike (cost.reproduced): an inversion up to this much is then the machine's
MACHINE_INVERSION = 1.5
JITTER_S = 0.5e-3  # allowed on top of both, absolutely: a tiny model's millisecond steps jitter by that much
MEASURE_BUDGET_S = 6.0  # timed passes of one measurement, both prefixes together
MEASURE_CEILING_S = 20.0  # a second try only if the first took under half of this
# Cheap steps (a tiny model's, well under a millisecond) jitter by a good part of their time: their sizes get more
# timed passes, up to MEASURE_FLOOR_S of them at each prefix (a median of 3 there moves trees by whole levels).
MEASURE_FLOOR_S = 0.5
MAX_PASSES = 64
# What a run prices its trees by when its measurement stayed doubtful (CostModel.fallback): each verified token beyond
# the root at this share of a plain step. The curves measured on this project's CPUs cost 8 tokens 1.3-2.2 plain steps
# and 16 tokens 1.6-4.1 (fp32 cheapest, the half types on AVX2 dearest); this prices them 1.84 and 2.8.
PRIOR_PER_TOKEN = 0.12
# A measurement on the CPU during which other processes kept busy CPUs its threads need (tr_engine/model/threads.py:
# with 2 threads on 2 CPUs beside one busy process every op waits for the thread sharing a CPU, and a 2-token verify
# timed at 10 plain steps) is doubtful. "0" in this variable leaves that check out: the test suite's two workers keep
# each other's CPUs busy by design, and tests/test_adaptive.py tests the check itself.
LOAD_CHECK_ENV = "TR_ENGINE_LOAD_CHECK"
# How a curve is measured, in the cache key: a curve cached by an earlier way of measuring is measured again.
# (2: each size priced against the plain step just before it.)
MEASURED = 2


@torch.inference_mode()
def time_steps(model, cache, sizes, prefix: int, reps: int, with_argmax: bool = True,
               top_k: int = 8, budget_s: float | None = None, warm_up: bool = True,
               max_relative: float | None = None, samples: dict | None = None, on_step=None,
               floor_s: float | None = None, paired: bool = False) -> dict[int, float]:
    """Median seconds of one forward of T tokens (a breadth-first tree; T = 1 is a plain decode step, no mask) after
    `prefix` cached tokens, for every T in `sizes` (increasing), timed in alternation so that a noisy spell hits every
    size alike: `reps` passes over the sizes after a warm-up pass (unless `warm_up` is False: a second prefix, whose
    first calls of each size have nothing left to set up), or fewer (one at least) once the timed passes have taken
    `budget_s` (a 7B model's pass takes half a minute on a CPU, a small model's a second), or more (up to MAX_PASSES)
    until they have taken `floor_s` (a tiny model's pass takes milliseconds, and its timings jitter). With
    `max_relative`, the sizes after the first that took more than that many plain steps are not timed again, nor
    returned (judged in the warm-up pass at twice the limit, then in the first timed one). `samples`, if given, receives
    every timing of each size, and under "before" and "after" three more plain steps' timed just before and after the
    passes (a noisy spell shows as a difference); `on_step()` is called after each forward.
    With `paired` (sizes[0] must be 1), every bigger size is timed right after a plain step of its own, and its time
    comes back as the median of its ratios to the plain steps around it (the median of the one before the size
    before, its own and the next size's, or the one that ends the pass), times the median plain step: a shared
    host's speed drifts within seconds, and a ratio of neighbours cancels the drift that a ratio of medians, taken a
    pass apart, kept; the median of three keeps one plain step that a busy neighbour stretched from bending the curve
    (a tiny model's steps take milliseconds, and a scheduler tick is a good part of one).
    With `with_argmax`, each timing includes the argmax over the logits and its host sync (what a decode step pays);
    under tensor parallelism a tree's includes instead the merge of its rows' top-`top_k` across the ranks (what a
    greedy verify step pays: tr_engine/core/speculative.py). Overwrites the cache's slots 0..prefix+max(sizes)-1 and
    leaves cache.length = 0."""
    sharded = model.shard.world > 1
    # Under tensor parallelism every rank runs these forwards together, so every decision below (which sizes stay, when
    # a pass ends) must come out alike on all of them: each time is the ranks' largest (Shard.agree). Decided from
    # each rank's own clock, a rank that stopped a pass early left the other inside a forward's collective.
    agree = model.shard.agree
    g = torch.Generator().manual_seed(0)
    device = cache.data.device
    ids = torch.randint(0, model.config.vocab_size, (prefix + 1,), generator=g).to(device)
    cache.reset()
    model(ids[:prefix], torch.arange(prefix, device=device), cache.data, 0, last_logits_only=True)  # the prefix's K/V
    masks = {T: sample_tree_mask(T).to(device) for T in sizes if T > 1}
    depths = {T: prefix + m.sum(dim=1) - 1 for T, m in masks.items()}  # ancestors above a token = its depth

    def step(T: int):
        if T == 1:
            logits = model(ids[prefix:], torch.tensor([prefix], device=device), cache.data, prefix)
        elif sharded and with_argmax:
            logits = model.top_k(model(ids[prefix:].repeat(T), depths[T], cache.data, prefix, tree_mask=masks[T],
                                       gather=False), top_k)[1]
        else:
            logits = model(ids[prefix:].repeat(T), depths[T], cache.data, prefix, tree_mask=masks[T])
        if with_argmax:
            greedy(logits, model.ops).tolist()
        elif device.type == "cuda":
            torch.cuda.synchronize()
        if on_step is not None:
            on_step()

    def plain_steps(n: int = 3) -> list[float]:
        timed = []
        for _ in range(n):
            t0 = time.perf_counter()
            step(1)
            timed.append(agree(time.perf_counter() - t0))
        return timed

    times = {T: [] for T in sizes}
    ratios = {T: [] for T in sizes}  # (paired: each timing over the plain steps around it)
    kept = list(sizes)
    start = None
    before = None
    yardstick = float("inf")
    if warm_up:  # the very first forward sets things up: the warm-up pass's plain step is then a fair yardstick
        t0 = time.perf_counter()
        step(1)
        yardstick = agree(time.perf_counter() - t0)  # (and the lesser of the two: one late wake-up would let dear
        # sizes in)
    n = 0
    while True:
        warm = warm_up and n == 0  # the warm-up pass: first-call allocations and kernel selection, not kept
        if not warm and start is None:
            before = plain_steps() if samples is not None else None
            start = time.perf_counter()
        judging = max_relative is not None and n <= (1 if warm_up else 0)  # (a warm-up, with its first calls, more
        limit = None  # leniently, at twice the limit; then the first timed pass)
        plains, dear = [], []  # (paired: this pass's plain steps, the first, one before each size and one after the
        # last; the sizes' timings)
        for i, T in enumerate(list(kept)):
            if paired and i > 0:
                t0 = time.perf_counter()
                step(1)
                pair = agree(time.perf_counter() - t0)
            t0 = time.perf_counter()
            step(T)
            elapsed = agree(time.perf_counter() - t0)
            if not warm:
                times[T].append(elapsed)
                if paired:
                    plains.append(elapsed if i == 0 else pair)
                    if i > 0:
                        times[1].append(pair)
                        dear.append((T, elapsed))
            if judging and i == 0:
                limit = max_relative * (2 if warm else 1) * (min(elapsed, yardstick) if warm else elapsed)
            elif judging and elapsed > limit:  # the first too dear one stays, the curve's edge; the rest go
                kept = kept[:i + 1]
                break
        if dear:  # one more plain step, after the last size
            t0 = time.perf_counter()
            step(1)
            plains.append(agree(time.perf_counter() - t0))
        for j, (T, elapsed) in enumerate(dear, 1):
            ratios[T].append(elapsed / statistics.median(plains[j - 1:j + 2]))
        n += 1
        timed = n - (1 if warm_up else 0)
        spent = agree(time.perf_counter() - start) if start is not None else 0.0  # by the timed passes
        if budget_s is not None and timed >= 1 and spent >= budget_s:
            break
        if timed >= reps and (floor_s is None or spent >= floor_s or timed >= MAX_PASSES):
            break
    if samples is not None:
        samples.update({T: times[T] for T in kept}, before=before, after=plain_steps())
    cache.reset()
    if paired:
        plain = statistics.median(times[1])
        return {T: plain * statistics.median(ratios[T]) if i > 0 else plain for i, T in enumerate(kept)}
    return {T: statistics.median(times[T]) for T in kept}


@dataclass
class CostModel:
    """relative[p][i]: the cost of a verify of BUCKETS[i] tokens after PREFIXES[p] cached tokens, in plain steps."""

    buckets: tuple[int, ...]
    prefixes: tuple[int, ...]
    relative: list[list[float]]
    plain_s: list[float]  # seconds of a plain step at each prefix
    key: dict
    doubt: str | None = None  # why a measured curve is not to be cached (noisy, not monotone); None: trusted

    def _weight(self, prefix: int) -> float:
        """Where `prefix` lies between the two measured prefixes: 0 at the first, 1 at the second, extrapolated
        linearly past it (attention's cost grows with the prefix: a long RAG prompt costs more than 1024 tokens'
        worth), up to 8 spans out; clamped at 0 below the first."""
        p0, p1 = self.prefixes
        return min(max((prefix - p0) / (p1 - p0), 0.0), 8.0) if p1 > p0 else 0.0

    def cost(self, tokens: int, prefix: int) -> float:
        """Relative cost of a `tokens`-token verify (a bucket size) after `prefix` cached tokens."""
        i = self.buckets.index(tokens)
        w, rows = self._weight(prefix), self.relative
        return (1 - w) * rows[0][i] + w * rows[1][i]

    def curve(self, prefix: int) -> list[float]:
        """The relative cost of every bucket after `prefix` cached tokens."""
        w = self._weight(prefix)
        return [(1 - w) * a + w * b for a, b in zip(*self.relative)]

    def seconds(self, tokens: int, prefix: int) -> float:
        """Predicted seconds of a verify of any `tokens` up to the largest bucket (linear between buckets)."""
        w = self._weight(prefix)
        plain = (1 - w) * self.plain_s[0] + w * self.plain_s[1]
        i = next(i for i, T in enumerate(self.buckets) if T >= tokens)
        rel = self.cost(self.buckets[i], prefix)
        if self.buckets[i] > tokens:  # between buckets i-1 and i
            lo, hi = self.buckets[i - 1], self.buckets[i]
            rel += (self.cost(lo, prefix) - rel) * (hi - tokens) / (hi - lo)
        return rel * plain

    @classmethod
    def flat(cls, max_tokens: int = BUCKETS[-1]) -> "CostModel":
        """Every verify up to `max_tokens` costs one plain step: a device with compute to spare, in the limit. Pinned to
        a drafter (Engine.new_drafter's `cost`), it makes the adaptive tree as big as allowed: its drafts at a given
        size, compared with a static tree's."""
        buckets = tuple(T for T in BUCKETS if T <= max_tokens)
        return cls(buckets, PREFIXES, [[1.0] * len(buckets)] * 2, [0.0, 0.0], {"flat": max_tokens})

    def fallback(self) -> "CostModel":
        """A doubtful curve's stand-in for the run that measured it (calibrated): the same sizes and prefixes, each
        verify priced at 1 + PRIOR_PER_TOKEN plain steps a token beyond the root, the doubt kept (never cached). A curve
        timed through a busy spell can be anything (a plain step 37x slower after it than before: 6 tokens at 11
        plain steps, every tree priced out), so the run drafts by a middling guess and the next run measures again."""
        rel = [1.0 + PRIOR_PER_TOKEN * (T - 1) for T in self.buckets]
        return CostModel(self.buckets, self.prefixes, [rel] * len(self.prefixes), self.plain_s, self.key, self.doubt)

    @classmethod
    def measure(cls, model, cache, key: dict, reps: int = 3, top_k: int = 8, budget_s: float = MEASURE_BUDGET_S,
                progress=None) -> "CostModel":
        """Time the buckets that fit twice over in the cache (all of them from 256 slots up), after the PREFIXES
        clamped to what the biggest leaves (time_steps: `top_k` is the matrix's k; `reps` passes, fewer past
        `budget_s` of them in all; sizes dearer than MAX_RELATIVE plain steps left out and extrapolated). A doubtful
        curve (see `distrust`) is measured once more if that fits in MEASURE_CEILING_S; if it is still doubtful, it
        comes back with its `doubt` set (the reasons found at every prefix; calibrated does not cache it).
        `progress(fraction)` is called as the forwards run. A cache too small for a draft gets a curve of plain steps
        only."""
        sizes = tuple(T for T in BUCKETS if T <= cache.capacity // 2)
        if len(sizes) < 2:
            return cls((1,), (0, 0), [[1.0], [1.0]], [0.0, 0.0], key)
        prefixes = tuple(min(p, cache.capacity - sizes[-1]) for p in PREFIXES)
        # progress: forwards done over those planned (sizes past MAX_RELATIVE drop out, so it may jump ahead); a
        # second try goes on from where the first left it, over about as many forwards as the first took
        done, reported = 0, 0.0
        # this try's first forward, the fraction reported then, and the forwards it plans (the first try: a warm-up
        # pass and the timed ones at each prefix, each size after a plain step of its own; three plain steps 4 times)
        first, at_first, planned = 0, 0.0, 2 * len(sizes) * (1 + 2 * reps) + 12

        def on_step():
            nonlocal done, reported
            done += 1
            reported = min(at_first + (1.0 - at_first) * (done - first) / planned, 1.0)
            if progress is not None:
                progress(reported)

        start, tries = time.perf_counter(), []  # (each try's timings at each prefix)
        watch_load = model.device.type == "cpu" and os.environ.get(LOAD_CHECK_ENV, "1") != "0"
        for attempt in range(2):
            relative, plain, reasons, timed, noisy = [], [], [], [], False
            load = CpuLoad() if watch_load else None
            for i, prefix in enumerate(prefixes):
                samples = {}
                s = time_steps(model, cache, sizes, prefix, reps, top_k=top_k, budget_s=budget_s / len(prefixes),
                               warm_up=i == 0, max_relative=MAX_RELATIVE, samples=samples, on_step=on_step,
                               floor_s=MEASURE_FLOOR_S, paired=True)
                # (each prefix's reasons, each once: noise at one must not hide a drift at the other)
                reasons += [r for r in distrust(s, samples) if r not in reasons]
                noisy = noisy or drift(samples) is not None
                timed.append(s)
                relative.append(envelope(s, sizes))
                plain.append(s[1])
            threads = torch.get_num_threads()
            if load is not None and (others := load.crowds(threads)) is not None:
                noisy = True
                reasons.append(f"other processes kept {others:.1f} of the {len(load.cpus)} CPUs busy, so its {threads} "
                               "threads waited on each other")
            tries.append(timed)
            doubt = "; ".join(reasons) or None
            if doubt is not None and attempt == 1 and not noisy and reproduced(*tries):
                doubt = None  # inversions timed alike twice over: this machine's curve (the envelope prices it)
            # (rank 0's choice under tensor parallelism: a rank's own CPU load may doubt a curve another's does not)
            if model.shard.from_rank0(doubt is None or time.perf_counter() - start > MEASURE_CEILING_S / 2):
                break
            first, at_first, planned = done, reported, done  # the second try's forwards, about the first's
        if progress is not None:
            progress(1.0)
        return cls(sizes, prefixes, relative, plain, key, doubt)

    def save(self, path: Path) -> None:
        """Write the curve atomically (tr_engine/files.py); OSError when the folder refuses."""
        text = json.dumps({"buckets": self.buckets, "prefixes": self.prefixes, "relative": self.relative,
                           "plain_s": self.plain_s, "key": self.key}, indent=1) + "\n"
        atomic_write(path, text.encode())

    @classmethod
    def load(cls, path: Path, key: dict) -> "CostModel | None":
        """The cached curve at `path` if it was measured for `key` and every current bucket size, else None (a curve
        measured in a small cache is measured again: a bigger cache can afford bigger trees)."""
        try:
            d = json.loads(path.read_text())
            if d["key"] != key or tuple(d["buckets"]) != BUCKETS:
                return None
            prefixes, relative, plain_s = tuple(d["prefixes"]), d["relative"], d["plain_s"]
            if not (len(prefixes) == len(relative) == len(plain_s) >= 1
                    and all(len(row) == len(BUCKETS) for row in relative)
                    and all(_positive(x) for x in [*prefixes, *plain_s, *(c for row in relative for c in row)])):
                return None  # edited or damaged: measure again rather than plan trees from it
            return cls(BUCKETS, prefixes, relative, plain_s, d["key"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # missing or unreadable: measure again


def drift(samples: dict) -> float | None:
    """How many times as long the plain step took after a measurement at one prefix as before it, or the other way
    round (time_steps' samples), if by more than NOISE: the machine was busier in one than the other, and the sizes
    timed in between are not comparable. None if within."""
    before, after = statistics.median(samples["before"]), statistics.median(samples["after"])
    low, high = sorted((before, after))
    return high / low if high > NOISE * low + JITTER_S else None


def inversions(seconds: dict[int, float]) -> list[tuple[int, int]]:
    """The sizes T timed well under a smaller one (by more than MONOTONE), each as (T, the dearest smaller size)."""
    sizes, found = sorted(seconds), []
    for i, T in enumerate(sizes):
        smaller = max(sizes[:i], key=lambda S: seconds[S], default=None)
        if smaller is not None and seconds[T] * MONOTONE + JITTER_S < seconds[smaller]:
            found.append((T, smaller))
    return found


def distrust(seconds: dict[int, float], samples: dict) -> list[str]:
    """Why a measurement at one prefix (time_steps' medians and samples) is not to be trusted, if it is not: a drift
    of the plain step from before the passes to after them, and/or a size timed well under a smaller one (the worst
    such inversion: a spell of noise makes small ones too). Both are named when both hold: a busy spell does not hide
    a curve no machine gives."""
    reasons = []
    if (moved := drift(samples)) is not None:
        reasons.append(f"a plain step took {moved:.1f}x as long after the measurement as before (was another process "
                       "busy?)")
    if found := inversions(seconds):
        T, smaller = max(found, key=lambda pair: seconds[pair[1]] / seconds[pair[0]])
        reasons.append(f"a {T}-token verify timed under a {smaller}-token one")
    return reasons


def reproduced(first: list[dict[int, float]], second: list[dict[int, float]]) -> bool:
    """Whether two tries' timings (time_steps' seconds at each prefix) give one curve: every size both timed costs
    the same number of plain steps in both, within MONOTONE (and a tiny model's jitter), and no size is under a
    smaller one by more than MACHINE_INVERSION. Then the second's inversions are the machine's, not noise (the module's
    docstring)."""
    for a, b in zip(first, second):
        for T in set(a) & set(b) - {1}:
            x, y, jitter = a[T] / a[1], b[T] / b[1], JITTER_S / min(a[1], b[1])
            if max(x, y) > MONOTONE * min(x, y) + jitter:
                return False
        if any(b[smaller] > MACHINE_INVERSION * b[T] for T, smaller in inversions(b)):
            return False
    return True


def envelope(seconds: dict[int, float], sizes: tuple[int, ...]) -> list[float]:
    """The relative cost of every size, in plain steps: the timed ones made non-decreasing (a bigger verify never
    costs less than a smaller one; small inversions are noise), the untimed ones past the last timed (too dear to
    time: time_steps' max_relative) in proportion to their tokens."""
    rel, top = [], 0.0
    last = max(seconds)
    for T in sizes:
        top = max(top, (seconds[T] if T in seconds else seconds[last] * T / last) / seconds[1])
        rel.append(round(top, 4))
    return rel


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


def cost_key(model_name: str, dtype: torch.dtype, device: torch.device, ops: str, cuda_graphs: bool = False,
             tp: int = 1, cpu_tier: str | None = None) -> dict:
    """What the cost curve depends on; a cached curve with another key is measured again. (`tp`: a step under
    tensor parallelism pays the ranks' collectives too, a cost of its own; `cpu_tier`: the CPU kernels' instruction
    set, tr_engine/model/cpu.py, whose verify costs differ most of all.)"""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu.model_name()
    return {"model": model_name, "dtype": str(dtype).removeprefix("torch."), "device": where,
            "threads": torch.get_num_threads(), "ops": ops, "torch": torch.__version__,
            "build": kernels_build(cpu_tier) if "kernels" in ops else None, "cuda_graphs": cuda_graphs, "tp": tp,
            "cpu_tier": cpu_tier, "measured": MEASURED}


def kernels_build(cpu_tier: str | None = None) -> str:
    """A fingerprint of the compiled kernels (their files' hash): the op library's and, on a CPU, the library of the
    tier in use (tr_engine/model/cpu.py), where the CPU kernels are. A rebuilt kernel has another cost curve. (Hashing
    the op library alone kept a curve measured with the CPU kernels before a change.)"""
    import tr_engine._C

    files = [Path(tr_engine._C.__file__)]
    if cpu_tier:
        library = cpu.library(cpu.tier(cpu_tier))
        files += [library] if library is not None else []
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.read_bytes())
    return digest.hexdigest()[:12]


def cost_path(home: Path, key: dict) -> Path:
    safe = lambda s: "".join(c if c.isalnum() or c in "-._" else "_" for c in str(s))  # noqa: E731
    variant = ("-graphs" if key.get("cuda_graphs") else "") + (f"-tp{key['tp']}" if key.get("tp", 1) > 1 else "")
    tier = f"-{key['cpu_tier']}" if key.get("cpu_tier") else ""
    name = f"{key['model']}-{key['dtype']}-{key['device']}{tier}-t{key['threads']}-{key['ops']}{variant}.json"
    return home / "costs" / safe(name)


def calibrated(model, cache, key: dict, path: Path, shard, top_k: int, notify=None,
               again: bool = False) -> tuple[CostModel, bool]:
    """The curve for `key` and whether it was measured now: loaded from `path`, or (`again`, or none saved) measured
    with `model` in `cache` (overwriting it) and saved there; a measurement still doubtful after its second try is
    not saved, and the run prices its trees by its fallback. Under tensor parallelism every rank measures together
    and rank 0's curve is kept. `notify(fraction, doubt)` hears a measurement: 0.0, fractions, then 1.0 with its
    doubt."""
    cost = None if again else CostModel.load(path, key)
    measure = shard.from_rank0(cost is None)
    if measure:
        notify = notify or (lambda fraction, doubt=None: None)
        notify(0.0, None)
        cost = CostModel.measure(model, cache, key, top_k=top_k, progress=lambda fraction: notify(fraction, None))
        notify(1.0, cost.doubt)
        try:
            if shard.rank == 0 and cost.doubt is None:
                cost.save(path)
        except OSError:
            pass  # a read-only home: measure again next time
        if cost.doubt is not None:
            cost = cost.fallback()
    return shard.from_rank0(cost), measure
