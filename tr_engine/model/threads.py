"""How many threads the CPU ops run on when the user did not say: torch's default, less the CPUs other processes keep
busy.

A parallel op splits its work among the threads and waits at its end for the last of them. Where another process
keeps a CPU busy, the thread sharing that CPU runs a scheduler slice at a time and every op waits for it, while the
other threads spin (libgomp, torch's OpenMP runtime, spins before it sleeps) and keep their own CPUs from it. SmolLM2
in bf16, plain decoding on the 2-core AVX2 host (AMD EPYC, Zen 3 class), tok/s: idle, 2 threads 71 and 1 thread 48;
beside one busy process, 2 threads 24 and 1 thread 50 (bench/results/threads.md). libgomp's passive wait
(OMP_WAIT_POLICY=passive) recovered 47-48 of 57-59 there, but cost ~11% idle.

`LoadFollower.tick()`, called by the decode loop between steps, looks at the CPUs every PERIOD_S: the busy time of
the CPUs this process may use (/proc/stat, steal included: a vCPU its host runs elsewhere is as busy) less this
process's own (time.process_time: all its threads) is the others' load, in CPUs. The threads are the CPUs the others
leave, rounded (at least 1, at most the starting count), and a new count takes two looks in a row that agree, so a
load at the rounding's edge does not flap it. The thread count changes no result: every CPU kernel splits its work
by outputs (rows, heads, blocks of output columns), never inside one sum (tests/test_model.py holds 1 and 2 threads
to the same bits). A count given by the user (--threads, Engine.from_pretrained(threads=...)) is kept as given:
benchmarks and research runs time a fixed one.
"""

import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

PERIOD_S = 1.0  # seconds between looks at the CPUs
STARTING = torch.get_num_threads()  # torch's count when the engine was imported: a following engine's most
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


class LoadFollower:
    """Sets torch's thread count to `most` (default STARTING: another engine may have set a count of its own since),
    then to the CPUs other processes leave, up to `most`, looked at every `period_s` of `now()` from the decode loop
    (tick). `read()` -> (busy CPU seconds of the usable CPUs, this process's CPU seconds) reads the machine (None where
    there is no /proc/stat: the count then stays as it is)."""

    def __init__(self, most: int | None = None, period_s: float = PERIOD_S, read=None, now=time.monotonic,
                 set_threads=torch.set_num_threads):
        self.most = most or STARTING
        self.period_s, self.now, self.set_threads = period_s, now, set_threads
        set_threads(self.most)
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.read = read or self.clocks
        self.threads, self.pending = self.most, None
        self.at, self.last = self.now(), self.read()

    def clocks(self) -> tuple[float, float] | None:
        try:
            stat = PROC_STAT.read_text()
        except OSError:
            return None
        return busy_seconds(self.cpus, stat), time.process_time()

    def tick(self) -> None:
        """Between steps: every period_s, the others' load since the last look, and the thread count for it."""
        at = self.now()
        if self.last is None or at - self.at < self.period_s:
            return
        now = self.read()
        if now is None:
            return
        busy, own = (a - b for a, b in zip(now, self.last))
        others = max(0.0, (busy - own) / (at - self.at))
        self.at, self.last = at, now
        want = threads_for(others, len(self.cpus), self.most)
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
        self.set_threads(self.most)
        try:
            yield
        finally:
            self.set_threads(before)
