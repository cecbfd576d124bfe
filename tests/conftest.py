"""Shared fixtures: tiny random Llama folders written on the spot, the default SmolLM2 model (fetched by `make test`
before pytest runs, or here on first use), and Hugging Face `transformers` as the reference implementation."""

import json
import os
import signal
from typing import NamedTuple

# `make test` runs one test worker per CPU (pytest-xdist): each worker, and each command it starts (OMP_NUM_THREADS),
# runs on its share of the CPUs, so that two workers never fight over a core (and a command keys its cost curve by the
# same thread count as the worker's engines: default_model_curve). The kernel tests run on two threads whatever the
# share (cpu_tier), so that an op's work split between threads is always exercised.
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = min(2, max(1, CPUS // WORKERS))
os.environ["OMP_NUM_THREADS"] = str(THREADS)
# Where those two threads outnumber the worker's share, a thread that reaches the end of a parallel region first would
# spin (OpenMP's default) on a core that the other worker needs, while its partner waits for that very core: the kernel
# tests ran 7-10x slower beside a busy core (the attention's row tests 84-100 s against 13 s passive; ~2 minutes of
# the suite's 7). Waiting threads sleep instead. Read by the OpenMP runtime when it loads, with torch: set before.
if CPUS // WORKERS < 2:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from curves import pinned  # noqa: E402
from weights_tools.tiny_llama import write_tiny_llama  # noqa: E402

torch.set_num_threads(THREADS)
# Weights in ordinary pages (csrc/cpu/packed_linear.cpp): on this project's VMs a huge page costs ~15 ms at its first
# touch, 3-6 s of every load of the default model, and the suite loads it dozens of times. (Read by the op library at
# its first packing, and by every command a test starts; test_weights holds the default, advised, to its own test.)
os.environ.setdefault("TR_ENGINE_HUGE_PAGES", "0")
# A cost curve measured while other processes keep busy the CPUs its threads need is doubtful (tr_engine/core/cost.py);
# the suite's own workers and commands are such processes, by design. Off for the suite (set before any command it
# starts); test_adaptive tests the check with it on.
os.environ.setdefault("TR_ENGINE_LOAD_CHECK", "0")
# Started in the background of a shell without job control, this process inherits SIGINT ignored, and Python then
# never raises KeyboardInterrupt (nor do the commands the tests start): the Ctrl-C tests need the normal handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: loads the 135M-parameter default model, or rehearses a whole benchmark")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        # (the marker itself: item.keywords would also match a parameter id that happens to be "cuda")
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(skip)


def run_folder(tmp_path_factory):
    """The folder of this test run that all its workers share (a worker's base folder is in it, beside the others')."""
    return tmp_path_factory.getbasetemp().parent if WORKERS > 1 else tmp_path_factory.getbasetemp()


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory):
    """The tests' own $TR_ENGINE_HOME (cost curves, matrices), still finding models in the real one. The workers of
    one run share its cost curves: each curve measured once, not once a worker (~15 s for the default model)."""
    from tr_engine.model.folders import home

    os.environ.setdefault("TR_ENGINE_MODELS", str(home() / "models"))
    private = tmp_path_factory.mktemp("home")
    if WORKERS > 1:
        shared = run_folder(tmp_path_factory) / "costs"
        shared.mkdir(exist_ok=True)
        (private / "costs").symlink_to(shared, target_is_directory=True)
    os.environ["TR_ENGINE_HOME"] = str(private)


def runnable_cpu_tiers() -> list[str]:
    """The CPU kernel tiers this machine can run, best first (tr_engine/model/cpu.py): on an AVX-512 machine with AMX
    amx, then avx512bf16 (with bf16 dot products), avx512, avx2 and scalar; on an AVX2 one avx2 and scalar."""
    from tr_engine.model import cpu

    try:
        return [t.name for t in cpu.runnable()]
    except ImportError:  # the op library is not built: the tests that need it say so
        return []


CPU_TIERS = runnable_cpu_tiers()
# Where avx512bf16 runs, avx512 is its code but for the bf16 matmuls (linear.h: the widened pairs pass in AVX-512
# tiles, which no other tier runs, where avx512bf16 takes bf16 dot products); where amx runs, avx512bf16 is its code
# but for the bf16 matmuls and attention (amx's on the tiles). A kernel test runs on every tier but those duplicates,
# and on them too in the modules that set EVERY_TIER = True (the matmuls', the attention's and what calls them): the
# rest a third time would add about 30 s to make test.
DUPLICATE_OF = {"avx512": "avx512bf16", "avx512bf16": "amx"}
KERNEL_TEST_TIERS = [t for t in CPU_TIERS if DUPLICATE_OF.get(t) not in CPU_TIERS]


def pytest_generate_tests(metafunc):
    if "cpu_tier" in metafunc.fixturenames:
        every = getattr(metafunc.module, "EVERY_TIER", False)
        metafunc.parametrize("cpu_tier", CPU_TIERS if every else KERNEL_TEST_TIERS, indirect=True)


@pytest.fixture
def cpu_tier(request):
    """Runs a test once per CPU tier in KERNEL_TEST_TIERS (or CPU_TIERS, every one this machine can run, in a module
    with EVERY_TIER = True), with that tier's kernels behind every CPU op (then the tier before), on at least two
    threads. A module opts in whole with `pytestmark = pytest.mark.usefixtures("cpu_tier")`."""
    from tr_engine.model import cpu

    before, threads = cpu.active(), torch.get_num_threads()
    cpu.use(request.param)
    torch.set_num_threads(max(2, threads))
    yield request.param
    torch.set_num_threads(threads)
    if before:
        cpu.use(before)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """tiny_factory(name, **kwargs) -> folder of a tiny random Llama (cached per name for the session)."""
    made = {}

    def make(name: str = "tiny", **kwargs):
        if name not in made:
            made[name] = write_tiny_llama(tmp_path_factory.mktemp(name), **kwargs)
        return made[name]

    return make


@pytest.fixture(scope="session")
def markov_folder(tiny_factory):
    """A float64 tiny Llama whose attention adds nothing (o_proj zeroed): its next token depends on the current one
    alone, so greedy decoding soon runs around a cycle, prompt lookup finds its continuation, and a recycling matrix
    that has seen a token drafts exactly the model's choices after it. Drafting pays there on any machine: the
    workload of the "it drafts" guards. Its K/V are still computed and cached like any model's."""
    from safetensors.torch import load_file, save_file

    folder = tiny_factory("markov", dtype=torch.float64, vocab_size=300, std=0.5)
    weights = load_file(folder / "model.safetensors")
    if any(w.any() for name, w in weights.items() if name.endswith("o_proj.weight")):
        save_file({name: w.zero_() if name.endswith("o_proj.weight") else w for name, w in weights.items()},
                  folder / "model.safetensors")
    return folder


@pytest.fixture(scope="session")
def smollm2_dir():
    from tr_engine.model.folders import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    """transformers' LlamaForCausalLM on the same converted folder, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from tr_engine.engine import Engine

    return pinned(Engine.from_pretrained(str(smollm2_dir), dtype="float32", max_context=1024))


@pytest.fixture(scope="session")
def smollm2_default(smollm2_dir):
    """SmolLM2 as the commands load it by default (dtype "auto": float16 on a CPU)."""
    from tr_engine.engine import Engine

    return Engine.from_pretrained(str(smollm2_dir), max_context=1024)


class DevAnswer(NamedTuple):
    question: str  # its question_id
    prompt: str  # its first turn
    tokens: int  # new tokens asked for
    ids: list[int]  # SmolLM2 fp32's plain greedy answer


@pytest.fixture(scope="session")
def smollm2_dev_answers(request, tmp_path_factory) -> list[DevAnswer]:
    """SmolLM2 fp32's plain greedy answers (32 new tokens) to the dev subset's first turns (tests/data/dev_subset.jsonl:
    one question per category group of shared/data/spec_bench_dev.jsonl): the reference that the tests hold TR's
    kernels and references and tensor parallelism to, decoded once a run (~20 s): the first worker to need them
    decodes them, under a lock, and the others read its file."""
    import fcntl
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(__file__).parent / "data" / "dev_subset.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    shared = run_folder(tmp_path_factory)
    saved = shared / "smollm2_dev_answers.json"
    with open(shared / "smollm2_dev_answers.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not saved.exists():
            smollm2 = request.getfixturevalue("smollm2")
            answers = [smollm2.generate(r["turns"][0], max_new_tokens=32, method="ar").token_ids for r in rows]
            saved.write_text(json.dumps(answers))
        answers = json.loads(saved.read_text())
    return [DevAnswer(r["question_id"], r["turns"][0], 32, ids) for r, ids in zip(rows, answers)]


@pytest.fixture(scope="session")
def default_model_curve(smollm2_dir, tmp_path_factory):
    """The default model's verify cost curve as its commands key it (float16 on a CPU, a worker's threads), in the
    run's shared costs folder (private_home): measured once a run, by the first worker to need it, and kept even if
    doubtful (then its fallback, the curve that run drafted by). Two busy workers make many measurements doubtful,
    and a doubtful curve is not cached, so each command of the default model measured it again (15-25 s each). For
    the tests that run those commands with the adaptive tree; test_default_model_names_paris checks that they find
    it."""
    import fcntl

    from tr_engine.core.cost import cost_path
    from tr_engine.engine import Engine
    from tr_engine.model.folders import home

    shared = run_folder(tmp_path_factory)
    done = shared / "default_model_curve.done"
    with open(shared / "default_model_curve.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            cost = Engine.from_pretrained(str(smollm2_dir)).cost_model()
            cost.save(cost_path(home(), cost.key))  # (again, or for the first time if it was doubtful)
            done.write_text(json.dumps(cost.key))
    return json.loads(done.read_text())


@pytest.fixture(scope="session", params=["bfloat16", "float16"])
def smollm2_half(smollm2_dir, request):
    from tr_engine.engine import Engine

    return pinned(Engine.from_pretrained(str(smollm2_dir), dtype=request.param, max_context=1024))
