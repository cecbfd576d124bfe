"""How many threads the CPU ops run on when the user did not say: the process's count (torch's), less the CPUs other
processes keep busy.

A parallel op splits its work among the threads and waits at its end for the last of them. Where another process
keeps a CPU busy, the thread sharing that CPU runs a scheduler slice at a time and every op waits for it, while the
other threads spin (libgomp, torch's OpenMP runtime, spins before it sleeps) and keep their own CPUs from it. SmolLM2
in bf16, plain decoding on the 2-core AVX2 host (AMD EPYC, Zen 3 class), tok/s: idle, 2 threads 71 and 1 thread 48;
beside one busy process, 2 threads 24 and 1 thread 50 (bench/results/threads.md). libgomp's passive wait
(OMP_WAIT_POLICY=passive) recovered 47-48 of 57-59 there, but cost ~11% idle.

`LoadFollower.tick()`, called by the decode loop between steps, looks at the CPUs every PERIOD_S: the busy time of
the CPUs this process may use (/proc/stat, steal included: a vCPU its host runs elsewhere is as busy) less this
process's own (time.process_time: all its threads) is the others' load, in CPUs. The threads are the CPUs the others
leave, rounded (at least 1, at most the process's count), and a new count takes two looks in a row that agree, so a
load at the rounding's edge does not flap it. The thread count changes no result: every CPU kernel splits its work
by outputs (rows, heads, blocks of output columns), never inside one sum (tests/test_threads.py holds 1, 2 and 3
threads to the same bits). `CpuLoad` also tells the cost curve's measurement whether other processes crowded its
threads (tr_engine/core/cost.py: such a curve is not cached). A count given by the user (--threads,
Engine.from_pretrained(threads=...)) is kept as given: benchmarks and research runs time a fixed one.
"""

import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from tr_engine.checks import cpu_set

PERIOD_S = 1.0  # seconds between looks at the CPUs
# The count a follower set last, and its `most`: an engine made while torch's count is still a follower's doing starts
# at that follower's most, not at a count the load lowered (any other count is the process's own: torch's, or set).
_last_set: tuple[int, int] | None = None
PROC_STAT = Path("/proc/stat")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # of a cpuN line's numbers: user, nice, system, irq, softirq, steal (not idle, iowait)


def busy_seconds(cpus: set[int], stat: str) -> float:
    """The CPU seconds `cpus` spent busy since boot, from /proc/stat's text (its per-CPU lines, in clock ticks)."""
    ticks = 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks += sum(int(fields[i]) for i in BUSY_FIELDS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


def threads_for(others: float, cpus: int, most: int) -> int:
    """The threads to run beside `others` CPUs' worth of other processes' load on `cpus` usable CPUs: the CPUs they
    leave, rounded half down, between 1 and `most`."""
    return max(1, min(most, math.ceil(cpus - others - 0.5)))


def read_cpus(cpus: set[int]) -> tuple[float, float] | None:
    """(busy CPU seconds of `cpus` since boot, this process's CPU seconds), or None without /proc/stat."""
    try:
        stat = PROC_STAT.read_text()
    except OSError:
        return None
    return busy_seconds(cpus, stat), time.process_time()


class CpuLoad:
    """Other processes' load on this process's CPUs, in CPUs, over a stretch of time: made at its start, `others()` at
    its end. `read()` -> (busy CPU seconds of the usable CPUs, this process's CPU seconds) reads the machine (None:
    nothing to read, and others() is None); `now()` is the wall clock."""

    def __init__(self, read=None, now=time.monotonic, cpus: set[int] | None = None, start=None):
        self.cpus = cpu_set() if cpus is None else cpus
        self.read, self.now = read or (lambda: read_cpus(self.cpus)), now
        self.at, self.first = start or (now(), self.read())
        self.end = None  # (the wall clock, the reading) of the last others()

    def others(self) -> float | None:
        self.end = self.now(), self.read()
        if self.end[1] is None or self.first is None:
            return None
        busy, own = (a - b for a, b in zip(self.end[1], self.first))
        return max(0.0, (busy - own) / max(self.end[0] - self.at, 1e-9))

    def next(self) -> "CpuLoad":
        """The stretch that starts where the last others() ended (no reading of its own)."""
        return CpuLoad(self.read, self.now, self.cpus, self.end)

    def crowds(self, threads: int) -> float | None:
        """The others' load if it took CPUs that `threads` threads need (fewer would run: threads_for), else None."""
        others = self.others()
        return others if others is not None and threads_for(others, len(self.cpus), threads) < threads else None


class LoadFollower:
    """Runs torch's thread count at `most` (default: torch's count now, unless a follower lowered it: that
    follower's most), then at the CPUs other processes leave, up to `most`, looked at every `period_s` of `now()`
    from the decode loop (tick). `read` as CpuLoad's (None where there is no /proc/stat: the count then stays)."""

    def __init__(self, most: int | None = None, period_s: float = PERIOD_S, read=None, now=time.monotonic,
                 set_threads=torch.set_num_threads, cpus: set[int] | None = None):
        now_count = torch.get_num_threads()
        self.most = most or (_last_set[1] if _last_set is not None and _last_set[0] == now_count else now_count)
        self.period_s, self.now, self._set = period_s, now, set_threads
        self.set_threads(self.most)
        self.threads, self.pending = self.most, None
        self.load = CpuLoad(read, now, cpus)

    def set_threads(self, n: int) -> None:
        global _last_set
        self._set(n)
        _last_set = n, self.most

    def tick(self) -> None:
        """Between steps: every period_s, the others' load since the last look, and the thread count for it."""
        load = self.load
        if load.first is None or self.now() - load.at < self.period_s:
            return
        others = load.others()
        if others is None:
            return
        self.load = load.next()
        want = threads_for(others, len(load.cpus), self.most)
        if want == self.threads:
            self.pending = None
        elif want == self.pending:  # the second look in a row that wants it
            self.threads, self.pending = want, None
            self.set_threads(want)
        else:
            self.pending = want

    @contextmanager
    def at_most(self):
        """All `most` threads for a while: the cost curve's measurement, keyed by that count
        (tr_engine/core/cost.py). The count before is back after."""
        before = torch.get_num_threads()
        self._set(self.most)
        try:
            yield
        finally:
            self._set(before)
