"""The chat: the real CLI in a subprocess (piped turns, a pseudo-terminal with Ctrl-C, /stats, the matrix saved on
exit and loaded at start, one-line errors), and the conversation API under it (KV reuse, equality with generate)."""

import json
import os
import pty
import re
import select
import signal
import sys
import time

import pytest
import torch
from cli import assert_one_line_error, call_main, run_module

from tr_engine.cli.chat import Session
from tr_engine.engine import Engine


def run_chat(*args, stdin="", env=None):
    return run_module("tr_engine.cli.chat", *args, stdin=stdin, env=env)


def call_chat(*args, stdin=""):
    """The chat's main() in this process, its stdin piped: for the tests of what it says (torch's import alone costs
    2-3 s of a core a process); the tests of the real CLI (a terminal, Ctrl-C, exit, the default model) start one."""
    from tr_engine.cli import chat

    return call_main(chat.main, *args, stdin=stdin.encode())


class Sink:
    def __init__(self):
        self.parts = []

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass


# --- the conversation API ---------------------------------------------------------------------------------------


@pytest.fixture
def tiny_engine(tiny_factory):
    return Engine.from_pretrained(str(tiny_factory("chat", dtype=torch.float64, vocab_size=300)), dtype="float64")


def second_turn_reuse(engine, method):
    """Two turns; returns (tokens cached after the first, the second's prompt ids, tokens the second prefilled)."""
    session = Session(engine, method, max_new_tokens=12, system=None, seed_from_prompt=False)
    session.ask("What is the capital of France?", Sink())
    first = session.results[-1]
    cached = list(engine.cached_ids)
    assert cached == (first.prompt_ids + first.token_ids)[: len(cached)]  # the cache holds the conversation so far
    assert len(cached) == len(first.prompt_ids) + len(first.token_ids) - 1  # all but the last answer token
    session.ask("And of Italy?", Sink())
    second = session.results[-1]
    return cached, second.prompt_ids, second.generation.prompt_tokens


@pytest.mark.parametrize("method", ["ar", "tr", "pld"])
def test_second_turn_prefills_only_what_the_cache_lacks(tiny_engine, method):
    """A random tiny model's answers need not re-tokenize to the same ids, so the reuse is the shared prefix."""
    cached, ids, prefilled = second_turn_reuse(tiny_engine, method)
    shared = next((i for i, (a, b) in enumerate(zip(cached, ids)) if a != b), min(len(cached), len(ids)))
    assert prefilled == len(ids) - shared


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "tr"])
def test_second_turn_prefills_exactly_the_new_turn_on_the_default_model(smollm2, method):
    cached, ids, prefilled = second_turn_reuse(smollm2, method)
    assert ids[: len(cached)] == cached  # the new prompt extends what is cached: nothing is recomputed
    assert prefilled == len(ids) - len(cached)  # the answer's last token, then the new turn's template and text


@pytest.mark.parametrize("method", ["ar", "tr", "pld", "hybrid"])
def test_chat_answers_equal_plain_decoding_on_the_same_conversation(tiny_engine, tiny_factory, method):
    """Every answer of a chat (its cache reused turn after turn, drafting with `method`) is plain decoding's on a
    fresh engine, given the conversation so far."""
    session = Session(tiny_engine, method, max_new_tokens=12, system="be brief", seed_from_prompt=False)
    fresh = Engine.from_pretrained(str(tiny_factory("chat", dtype=torch.float64, vocab_size=300)), dtype="float64")
    for text in ("hello there", "and again", "one more"):
        session.ask(text, Sink())
        want = fresh.generate(session.messages[:-1], max_new_tokens=12, method="ar")  # all before this answer
        assert session.results[-1].token_ids == want.token_ids
        assert session.messages[-1]["content"] == want.text


def test_interrupted_answer_is_kept_and_the_next_turn_works(tiny_engine):
    session = Session(tiny_engine, "tr", max_new_tokens=50, system=None, seed_from_prompt=False)

    class Interrupting(Sink):
        def write(self, s):
            super().write(s)
            if len(self.parts) == 2:
                raise KeyboardInterrupt

    sink = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        session.ask("hello there", sink)
    assert session.messages[-1] == {"role": "assistant", "content": "".join(sink.parts[:2])}
    assert tiny_engine.cached_ids == []  # nothing of an interrupted step is trusted
    session.ask("and again", Sink())  # a full prefill of the conversation, then a normal answer
    assert session.results[-1].generation.prompt_tokens == len(session.results[-1].prompt_ids)


# --- the command line -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_piped_two_turn_conversation_remembers_the_first_turn(smollm2_default, default_model_curve):
    proc = run_chat("--max-new-tokens", "30", "--no-persist", stdin="I live in Paris.\nWhich city do I live in?\n")
    assert proc.returncode == 0, proc.stderr
    answers = proc.stdout.strip().split("\n")
    assert len(answers) == 2, proc.stdout
    assert "Paris" in answers[1]
    # The chat's answers (the default method and dtype, its cache reused) are plain decoding's in the same session:
    # the first turn, then the second on top of the first's cached K/V (a fresh prefill of the whole conversation may
    # differ from it in the last bits: its rows are one forward, not the decode steps that computed the answer).
    smollm2 = smollm2_default
    first = [{"role": "user", "content": "I live in Paris."}]
    assert smollm2.generate(first, max_new_tokens=30, method="ar").text == answers[0]
    conversation = [*first, {"role": "assistant", "content": answers[0]},
                    {"role": "user", "content": "Which city do I live in?"}]
    assert smollm2.generate(conversation, max_new_tokens=30, method="ar", reuse_cache=True).text == answers[1]
    assert len(re.findall(r"^\[\d+ tokens, .* tok/s, MAT ", proc.stderr, re.M)) == 2, proc.stderr  # stats: stderr
    alone = smollm2.generate(conversation[2:], max_new_tokens=30, method="ar").text  # (what the chat would answer)
    assert "Paris" not in alone  # the second answer came from the conversation, not the question alone


@pytest.mark.slow
def test_stats_command(default_model_curve):
    proc = run_chat("--max-new-tokens", "24", "--no-persist", "--quiet", stdin="Say hello.\n/stats\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "/stats" not in proc.stdout  # only the answer on stdout
    for needle in ("last answer: 1 answer(s)", "session: 1 answer(s)", "MAT", "accepted per step:", "verify",
                   "recycle", "threads (following the load, up to"):
        assert needle in proc.stderr, proc.stderr


@pytest.mark.slow
def test_matrix_is_saved_on_exit_and_loaded_at_start(tmp_path, smollm2_dir):
    env = {**os.environ, "TR_ENGINE_HOME": str(tmp_path)}
    prompt = "Explain in two sentences how rain forms."

    # A static tree, so that MAT moves with the matrix alone (the adaptive default verifies a few tokens a step on
    # this CPU): two candidates at each of 6 depths, the top-ranked of each pair the parent of the next (the paper's
    # 81 nodes cost several plain steps a verify here, most of the test's time, and test nothing more).
    tree = tmp_path / "deep.json"
    tree.write_text(json.dumps([[0] * d + [last] for d in range(6) for last in (0, 1)]))

    def mat():
        proc = run_chat("--model", str(smollm2_dir), "--prompt", prompt, "--max-new-tokens", "48", "--tree", str(tree),
                        env=env)
        assert proc.returncode == 0, proc.stderr
        return float(re.search(r"MAT (\d+\.\d+)", proc.stderr).group(1))

    cold = mat()
    saved = list((tmp_path / "matrices").glob(f"{smollm2_dir.name}-*-k8.pt"))
    assert len(saved) == 1
    hot = mat()  # the same prompt, with the matrix the first session saved
    assert hot > cold + 0.3, (cold, hot)


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_and_the_session_goes_on():
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat, with the pseudo-terminal as its terminal
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a runner that ignores SIGINT would pass that on to the chat
        # (160 tokens: the story is still running ~150 tokens after the Ctrl-C is due, and the second answer, which
        # must name the dragon, does not run for 400)
        os.execvp(sys.executable, [sys.executable, "-m", "tr_engine.chat", "--method", "ar", "--no-persist",
                                   "--max-new-tokens", "160"])
    seen = ""

    def read_until(pattern, timeout=120):
        nonlocal seen
        start = len(seen)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if re.search(pattern, seen[start:]):
                return seen[start:]
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    seen += os.read(fd, 4096).decode(errors="replace")
                except OSError:
                    break
        raise AssertionError(f"{pattern!r} not seen; the terminal showed:\n{seen}")

    try:
        read_until(r">>> ")
        os.write(fd, b"Write a long story about a dragon who learns to bake bread.\n")
        read_until(r"bake bread\.\r?\n.{40,}")  # the echo, then 40 characters of the answer
        os.write(fd, b"\x03")  # Ctrl-C
        read_until(r"\[interrupted; the answer so far stays in the conversation\][\s\S]*>>> ")
        os.write(fd, b"What did I ask you to write about?\n")
        answer = read_until(r"\[\d+ tokens, .* tok/s, ar, prefill \d+ tokens[^\]]*\][\s\S]*>>> ")
        assert "dragon" in answer.lower()  # the interrupted turn is part of the conversation
        os.write(fd, b"/stats\n")
        read_until(r"last answer: 1 answer\(s\)[\s\S]*>>> ")
        os.write(fd, b"/quit\n")
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, seen
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


def test_unknown_model_name():
    assert_one_line_error(call_chat("--model", "no-such-model", "--prompt", "hi"), "unknown model", "vicuna-7b")


def test_missing_model_folder(tmp_path):
    assert_one_line_error(call_chat("--model", str(tmp_path / "missing"), "--prompt", "hi"), "does not exist")


def test_folder_without_weights(tiny_factory, tmp_path):
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for f in tiny_factory("chat-noweights").iterdir():
        if not f.name.endswith(".safetensors") and not f.name.endswith(".json.index"):
            (folder / f.name).write_bytes(f.read_bytes())
    assert_one_line_error(call_chat("--model", str(folder), "--prompt", "hi"), "no model.safetensors")


def test_corrupt_matrix_file_is_refused_and_left_alone(tiny_factory, tmp_path):
    bad = tmp_path / "matrix.pt"
    bad.write_bytes(b"not a matrix")
    proc = call_chat("--model", str(tiny_factory("chat-matrix")), "--matrix", str(bad), "--prompt", "hi")
    assert_one_line_error(proc, "is not a recycling matrix file", "delete it")
    assert bad.read_bytes() == b"not a matrix"


def test_prompt_answers_once(tiny_factory, tmp_path):
    """--prompt: the answer to that one message, with the system prompt, as plain decoding gives it; then the chat
    exits and saves its matrix."""
    matrix, folder = tmp_path / "m.pt", str(tiny_factory("chat-once"))
    proc = call_chat("--model", folder, "--prompt", "hi there", "--system", "be brief", "--max-new-tokens", "8",
                    "--matrix", str(matrix))
    assert proc.returncode == 0, proc.stderr
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    want = Engine.from_pretrained(folder).generate(conversation, max_new_tokens=8, method="ar").text
    assert proc.stdout == want + "\n" and matrix.is_file()


def test_a_refused_turn_is_reported_and_the_chat_goes_on(tiny_factory):
    """A turn too long for the context is one error line; the conversation does not keep it; the next line is answered;
    the exit status says a turn failed."""
    long_line = "word " * 200
    proc = call_chat("--model", str(tiny_factory("chat-overflow")), "--max-context", "128", "--max-new-tokens", "4",
                    "--no-persist", "--quiet", "--method", "ar", stdin=f"{long_line}\nhi\n")
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "context" in errors[0] and "Traceback" not in proc.stderr
    assert len(proc.stdout.splitlines()) == 1  # the second line's answer


def test_sampled_chat_is_seeded_and_the_temperature_can_change(tiny_factory, tmp_path, monkeypatch):
    import dataclasses

    from tr_engine.core.cost import CostModel

    folder = str(tiny_factory("chat", dtype=torch.float64, vocab_size=300))
    monkeypatch.setenv("TR_ENGINE_HOME", str(tmp_path))
    # The measured curve trusted however busy this machine is (CI once timed the tiny model's sub-millisecond steps
    # through a spell, and the doubtful curve, rightly not cached, was measured again by the next chat): this test is
    # about the chat caching what it measured; test_adaptive tests what a doubtful measurement does.
    measure = CostModel.measure
    monkeypatch.setattr(CostModel, "measure", classmethod(
        lambda cls, *a, **k: dataclasses.replace(measure(*a, **k), doubt=None)))
    turns = "hello there\n/temperature 1.5\nwhat now\n/temperature hot\n/temperature 0\nbye\n"
    args = ("--model", folder, "--dtype", "float64", "--max-new-tokens", "12", "--no-persist", "--temperature", "0.8",
            "--top-p", "0.95", "--seed", "3")
    runs = [call_chat(*args, "--method", m, stdin=turns) for m in ("tr", "ar", "hybrid")]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr
        assert "[temperature 1.5, top-p 0.95]" in proc.stderr and "[greedy]" in proc.stderr
        assert "usage: /temperature T" in proc.stderr  # "hot" is refused, the chat goes on
    assert runs[0].stdout == runs[1].stdout == runs[2].stdout  # same seed: the same answers, whatever the method
    notice = "measuring this machine's verify cost"
    assert runs[0].stderr.count(notice) == 1 and notice not in runs[2].stderr  # measured once, then cached
    other = call_chat(*args[:-1], "4", stdin=turns)
    assert other.stdout != runs[0].stdout
    assert_one_line_error(call_chat(*args, "--top-p", "2", stdin="hi\n"), "--top-p")
