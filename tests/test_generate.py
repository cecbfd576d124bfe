"""Greedy generation through the API and the one-shot command, and the command's one-line errors."""

import json

import pytest
import torch
from cli import assert_one_line_error, call_main, run_module

from tr_engine.engine import Engine
from tr_engine.errors import ContextOverflow, UserError


def run_cli(*args):
    """The command in this process (its errors are what these tests read; the command-line tests of
    test_hardening.py and the default model's below start real processes)."""
    from tr_engine.cli import generate

    return call_main(generate.main, *args)


def test_missing_model_folder(tmp_path):
    assert_one_line_error(run_cli("--model", str(tmp_path / "missing-model"), "--prompt", "hi"), "does not exist")


def test_unknown_model_name():
    assert_one_line_error(run_cli("--model", "no-such-model", "--prompt", "hi"), "unknown model", "vicuna-7b")


def test_known_model_not_present_says_how_to_get_it(tmp_path):
    proc = run_module("tr_engine.cli.generate", "--model", "vicuna-7b", "--prompt", "hi",
                      env={"TR_ENGINE_HOME": str(tmp_path), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert_one_line_error(proc, "lmsys/vicuna-7b-v1.3", "python -m weights_tools.bin_to_safetensors")


def test_prompt_beyond_the_cache(tiny_factory):
    folder = tiny_factory("float32", dtype=torch.float64)
    proc = run_cli("--model", str(folder), "--prompt", "word " * 100, "--max-context", "64")
    assert_one_line_error(proc, "needs", "the cache holds 64", "--max-new-tokens")


def test_empty_prompt(tiny_factory):
    assert_one_line_error(run_cli("--model", str(tiny_factory("float32", dtype=torch.float64)), "--prompt", "  "),
                          "prompt is empty")


def test_context_overflow_counts_new_tokens(tiny_factory):
    engine = Engine.from_pretrained(str(tiny_factory("float32", dtype=torch.float64)), max_context=64)
    engine.generate("hi", max_new_tokens=10, method="ar")
    with pytest.raises(ContextOverflow):
        engine.generate("hi", max_new_tokens=100, method="ar")
    # Speculative methods need no more room than plain decoding: near the end of the cache a draft is cut to fit.
    room = engine.cache.capacity - len(engine.prompt_ids("hi"))
    ar = engine.generate("hi", max_new_tokens=room, method="ar").token_ids
    for method in ("tr", "pld", "hybrid"):
        assert engine.generate("hi", max_new_tokens=room, method=method).token_ids == ar, method
    with pytest.raises(ContextOverflow):
        engine.generate("hi", max_new_tokens=room + 1, method="tr")
    with pytest.raises(UserError, match="outside 1..512"):
        Engine.from_pretrained(str(tiny_factory("float32", dtype=torch.float64)), max_context=100000)


def test_greedy_stops_exactly_at_eos(tiny_factory):
    """With the EOS id set to the token greedy emits at step k, generation ends there, EOS included."""
    engine = Engine.from_pretrained(str(tiny_factory("float32", dtype=torch.float64)), dtype="float64")
    free = engine.generate("hello", max_new_tokens=20, method="ar")
    assert len(free.token_ids) == 20 and free.generation.finish_reason == "length"
    k = 7
    engine.tokenizer.eos_ids = (free.token_ids[k],)
    first = free.token_ids.index(free.token_ids[k])
    stopped = engine.generate("hello", max_new_tokens=20, method="ar")
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.generation.finish_reason == "eos"


@pytest.mark.parametrize("method", ["ar", "hybrid"])
def test_ignore_eos_decodes_to_max_new_tokens_alone_and_in_a_batch(tiny_factory, method):
    engine = Engine.from_pretrained(str(tiny_factory("float32", dtype=torch.float64)), dtype="float64")
    free = engine.generate("hello", max_new_tokens=20, method="ar")
    engine.tokenizer.eos_ids = (free.token_ids[4],)
    assert len(engine.generate("hello", max_new_tokens=20, method=method).token_ids) < 20
    on = engine.generate("hello", max_new_tokens=20, method=method, ignore_eos=True)
    assert on.token_ids == free.token_ids and on.generation.finish_reason == "length"
    batch = engine.generate_batch(["hello", "why?"], max_new_tokens=20, method=method, ignore_eos=True)
    assert batch[0].token_ids == free.token_ids and len(batch[1].token_ids) == 20
    with pytest.raises(UserError, match="ignore_eos"):
        engine.generate("hello", ignore_eos="yes")


@pytest.mark.parametrize("method", ["ar", "hybrid"])
def test_a_call_cancelled_from_another_thread_ends_at_a_step_with_what_it_has(tiny_factory, method):
    import threading

    engine = Engine.from_pretrained(str(tiny_factory("float32", dtype=torch.float64)), dtype="float64")
    free = engine.generate("hello", max_new_tokens=60, method="ar")
    cancel = threading.Event()
    steps = engine.stream("hello", max_new_tokens=60, method=method, cancel=cancel)
    pieces = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            got = done.value
            break
        pieces += 1
        if pieces == 1:  # set from another thread, mid-answer: the stream ends at the next step boundary
            setter = threading.Thread(target=cancel.set)
            setter.start()
            setter.join()
    assert got.generation.finish_reason == "cancelled" and got.token_ids == free.token_ids[: len(got.token_ids)]
    assert 1 <= len(got.token_ids) < 60
    again = engine.generate("hello", max_new_tokens=60, method=method)  # the engine is as before
    assert again.token_ids == free.token_ids
    with pytest.raises(UserError, match="cancel must be"):
        engine.generate("hello", cancel=True)


def test_ops_reference_and_kernels_give_the_same_tokens(tiny_factory):
    folder = str(tiny_factory("float32", dtype=torch.float64))
    for method in ["ar", "tr"]:
        a = Engine.from_pretrained(folder, ops="reference").generate("hello", max_new_tokens=16, method=method)
        b = Engine.from_pretrained(folder, ops="kernels").generate("hello", max_new_tokens=16, method=method)
        assert a.token_ids == b.token_ids


@pytest.mark.slow
def test_default_model_names_paris(default_model_curve):
    proc = run_cli("--prompt", "What is the capital of France?", "--max-new-tokens", "32", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "measuring this machine's verify cost" not in proc.stderr  # the curve the fixture measured, found by key
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"]
    assert out["new_tokens"] == len(out["token_ids"]) > 0 and out["decode_s"] > 0


def test_one_op_swapped_by_the_ops_flag_gives_the_same_answer(tiny_factory):
    """--ops kernels,tree_attention=reference runs the reference attention inside the kernels' engine; in float64
    both agree to the last token."""
    folder = str(tiny_factory("float64", dtype=torch.float64))
    args = ["--model", folder, "--dtype", "float64", "--prompt", "hello there", "--max-new-tokens", "12", "--json"]
    whole = run_cli(*args)
    swapped = run_cli(*args, "--ops", "kernels,tree_attention=reference")
    assert whole.returncode == swapped.returncode == 0, swapped.stderr
    assert json.loads(whole.stdout)["token_ids"] == json.loads(swapped.stdout)["token_ids"]
    bad = run_cli(*args, "--ops", "kernels,attention=reference")
    assert bad.returncode == 2 and "--ops" in bad.stderr and bad.stderr.strip().count("\n") == 0


def test_prompts_file_answers_each_line_and_fails_a_bad_one_alone(tiny_factory, tmp_path):
    folder = str(tiny_factory("float64", dtype=torch.float64))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('hello there\n\n[{"role": "user", "content": "why?"}]\n[oops\nhello there\n')
    args = ["--model", folder, "--dtype", "float64", "--max-new-tokens", "6", "--method", "hybrid"]
    proc = run_cli(*args, "--prompts-file", str(prompts), "--batch", "2")
    assert proc.returncode == 2  # some requests failed; the others are answered
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2, 3, 4]
    assert "empty" in lines[1]["error"] and "not a JSON list of messages" in lines[3]["error"]
    alone = json.loads(run_cli(*args, "--prompt", "hello there", "--json").stdout)
    assert lines[0]["token_ids"] == lines[4]["token_ids"] == alone["token_ids"]
    assert len(lines[2]["token_ids"]) == 6
    assert proc.stderr.count("error: prompt") == 2
    missing = run_cli(*args, "--prompts-file", str(tmp_path / "none.txt"))
    assert_one_line_error(missing, "none.txt does not exist")
    both = run_cli(*args, "--prompts-file", str(prompts), "--prompt", "hi")
    assert both.returncode == 2 and "not allowed with" in both.stderr
