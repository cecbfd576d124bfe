"""The CPU thread count follows the machine's load (tr_engine/model/threads.py), and no thread count changes a bit of
what the model computes."""

import pytest
import torch

from tr_engine.model.kv_cache import KVCache
from tr_engine.model.threads import LoadFollower, busy_seconds, threads_for
from tr_engine.model.weights import load_model


def test_the_threads_are_the_cpus_the_others_leave_rounded_half_down():
    assert [threads_for(others, 2, 2) for others in (0.0, 0.3, 0.49, 0.5, 1.0, 1.6, 5.0)] == [2, 2, 2, 1, 1, 1, 1]
    assert threads_for(0.0, 16, 8) == 8 and threads_for(8.6, 16, 8) == 7 and threads_for(15.0, 16, 8) == 1


def test_busy_seconds_reads_the_usable_cpus_busy_and_stolen_ticks():
    import os

    hz = os.sysconf("SC_CLK_TCK")
    #       user nice system idle iowait irq softirq steal guest guest_nice
    stat = ("cpu  999 999 999 999 999 999 999 999 0 0\n"  # (the total line: not a CPU of its own)
            "cpu0 100 10 20 5000 300 1 2 7 0 0\n"
            "cpu1 40 0 10 9000 0 0 0 0 0 0\n"
            "cpu2 500 0 0 0 0 0 0 0 0 0\n"
            "intr 12345 0 0\nctxt 999\n")
    assert busy_seconds({0, 1}, stat) == pytest.approx((100 + 10 + 20 + 1 + 2 + 7 + 40 + 10) / hz)
    assert busy_seconds({2}, stat) == pytest.approx(500 / hz) and busy_seconds(set(), stat) == 0.0


class Machine:
    """A 2-CPU machine's clocks for a LoadFollower: `others` CPUs' worth of other processes' load and `ours` of this
    process's, advanced by `run(seconds)`."""

    def __init__(self):
        self.t, self.busy, self.own, self.others, self.ours, self.reads, self.set = 0.0, 0.0, 0.0, 0.0, 1.9, 0, []

    def run(self, seconds: float, others: float | None = None):
        self.others = self.others if others is None else others
        self.t += seconds
        self.busy += (self.others + self.ours) * seconds
        self.own += self.ours * seconds

    def read(self):
        self.reads += 1
        return self.busy, self.own

    def follower(self, period_s=1.0):
        return LoadFollower(2, period_s, self.read, lambda: self.t, self.set.append, cpus={0, 1})


def test_a_busy_neighbour_takes_a_thread_after_two_looks_and_gives_it_back_when_it_leaves():
    m = Machine()
    f = m.follower()
    assert m.set == [2] and f.threads == 2  # (its starting count, set)
    for _ in range(5):  # idle: nothing changes, and the machine is read once a period, not once a step
        m.run(0.25)
        f.tick()
    assert m.set == [2] and m.reads == 1 + 1  # (the first look at construction, one after a second)
    m.run(1.0, others=1.0)
    f.tick()
    assert f.threads == 2 and f.pending == 1  # one look alone does not move it
    m.run(1.0)
    f.tick()
    assert f.threads == 1 and m.set == [2, 1]
    m.run(1.0, others=0.1)
    f.tick()
    m.run(1.0)
    f.tick()
    assert f.threads == 2 and m.set == [2, 1, 2]


def test_a_stretch_beside_a_busy_process_crowds_two_threads_not_one():
    """CpuLoad: the others' load over a stretch, in CPUs, and whether it takes CPUs that a thread count needs."""
    from tr_engine.model.threads import CpuLoad

    m = Machine()
    load = CpuLoad(m.read, lambda: m.t, {0, 1})
    m.run(2.0, others=1.0)
    assert load.others() == pytest.approx(1.0) and load.crowds(2) == pytest.approx(1.0) and load.crowds(1) is None
    quiet = load.next()
    m.run(2.0, others=0.2)
    assert quiet.others() == pytest.approx(0.2) and quiet.crowds(2) is None
    assert CpuLoad(lambda: None, lambda: m.t, {0, 1}).crowds(2) is None  # (nothing to read: no verdict)


def test_a_load_at_the_edge_does_not_flap_the_count():
    m = Machine()
    f = m.follower()
    for i in range(10):  # a neighbour on and off, look by look: no two looks in a row agree on a change
        m.run(1.0, others=1.0 if i % 2 == 0 else 0.0)
        f.tick()
    assert m.set == [2] and f.threads == 2


def test_no_proc_stat_no_following_and_the_curve_measures_on_every_thread():
    m = Machine()
    blind = LoadFollower(2, 1.0, lambda: None, lambda: m.t, m.set.append, cpus={0, 1})
    m.run(5.0, others=2.0)
    blind.tick()
    assert blind.threads == 2 and m.set == [2]
    before = torch.get_num_threads()
    try:
        f = LoadFollower(2, 1.0, m.read, lambda: m.t, cpus={0, 1})
        torch.set_num_threads(1)  # (as the load had it)
        with f.at_most():
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_an_engine_follows_the_load_unless_its_threads_were_given(markov_folder, monkeypatch):
    """A CPU engine without `threads` follows the load, its decode loop looking between steps (generate and batches
    alike); one given `threads` keeps that count; the cost curve is measured at the starting count, its key's."""
    from tr_engine.core import drafting
    from tr_engine.engine import Engine

    before = torch.get_num_threads()
    try:
        fixed = Engine.from_pretrained(str(markov_folder), dtype="float64", threads=1)
        assert fixed.threads is None and fixed.pace is None and torch.get_num_threads() == 1
        torch.set_num_threads(2)  # (the process's own count, as torch's default or a user's set_num_threads)
        engine = Engine.from_pretrained(str(markov_folder), dtype="float64")
        assert engine.threads.most == 2 == torch.get_num_threads() == engine.drafting.key["threads"]
        engine.threads.set_threads(1)  # (as if the load had taken a thread)
        again = Engine.from_pretrained(str(markov_folder), dtype="float64")  # starts at the first one's most
        assert again.threads.most == 2 == torch.get_num_threads()
        looks, measured_on = [], []
        monkeypatch.setattr(engine.threads, "tick", lambda: looks.append(torch.get_num_threads()))
        engine.pace = engine.threads.tick
        calibrated = drafting.calibrated
        monkeypatch.setattr(drafting, "calibrated",
                            lambda *a, **k: measured_on.append(torch.get_num_threads()) or calibrated(*a, **k))
        torch.set_num_threads(1)  # (as if the load had taken a thread)
        engine.cost_model(recalibrate=True)  # measured on every thread, then back to the load's count
        assert measured_on == [2] and torch.get_num_threads() == 1
        result = engine.generate("hello hello", 12, method="tr", ignore_eos=True)  # (the curve cached: left alone)
        assert len(looks) >= result.generation.steps and set(looks) == {1} and measured_on == [2]
        looks.clear()
        results = engine.generate_batch(["hello", "tell me"], 6, method="tr", ignore_eos=True)
        assert len(looks) >= max(r.generation.steps for r in results) > 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_two_or_three_threads_compute_the_same_bits(tiny_factory, dtype, cpu_tier):
    """Every CPU kernel splits its work by outputs, never inside a sum, so the thread count the load sets changes
    nothing: a prompt, a decode step and an 8-token chunk give the same logits and K/V on 1, 2 and 3 threads (3 on
    fewer cores: other splits), on every CPU kernel tier. The model is wide enough that every op splits (its blocks
    of 32 outputs, its heads and row blocks), and its 3 KV heads of 64 dims past two blocks of 256 keys make the
    attention give a head's halves to two tasks on 2 threads, not on 1 or 3 (attention.h, split_point)."""
    folder = tiny_factory("threads", dtype=torch.bfloat16, vocab_size=1000, hidden_size=384, intermediate_size=704,
                          num_heads=6, num_kv_heads=3, std=0.5)
    model = load_model(folder, dtype)
    ids = torch.randint(0, model.config.vocab_size, (600,), generator=torch.Generator().manual_seed(5))
    model.set_max_positions(610)
    runs, before = [], torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            cache = KVCache(model.config, 610, dtype, "cpu")
            with torch.inference_mode():
                logits = torch.cat([model(ids[a:b], torch.arange(a, b), cache.data, a)
                                    for a, b in ((0, 591), (591, 592), (592, 600))])
            runs.append((logits, cache.data[:, :, :, :600].clone()))
    finally:
        torch.set_num_threads(before)
    for logits, kv in runs[1:]:
        assert torch.equal(logits, runs[0][0]) and torch.equal(kv, runs[0][1])
