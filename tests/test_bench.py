"""The benchmark harness end to end on a tiny model: the files it writes and what they say."""

import json
import math
from pathlib import Path

import pytest
import torch
from bench.ab import describe
from bench.machine import tier_suffix
from bench.shapes import SHAPES, projections
from cli import assert_one_line_error, call_main, run_module
from tr_engine.model import cpu


def bench_main(module: str, *args):
    """`python -m module args…` run in this process (call_main): the benchmarks whose tests read what they write, not
    how their process ends; the ones that start servers, checkouts or other tiers (bench.serve, bench.ab,
    bench.kernels) run in a subprocess."""
    import importlib

    return call_main(importlib.import_module(module).main, *args)


def test_specbench_two_questions_two_methods(tiny_factory, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"question_id": 1, "category": "writing", "turns": ["Write a line about the sea."]}) + "\n"
        + json.dumps({"question_id": 2, "category": "qa", "turns": ["Who are you?", "And why?"]}) + "\n")
    out = tmp_path / "out"
    proc = bench_main("bench.specbench", "--model", str(tiny_factory("bench", dtype=torch.float64)), "--dtype",
                      "float64", "--questions", str(questions), "--methods", "tr", "--max-new-tokens", "8",
                      "--warmup", "0", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "question" in proc.stderr  # the progress bar
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # question 1 has one turn, question 2 two; each turn ran ar and tr
    assert [(r["question_id"], r["turn"], r["method"]) for r in records] == [
        (1, 0, "ar"), (1, 0, "tr"), (2, 0, "ar"), (2, 0, "tr"), (2, 1, "ar"), (2, 1, "tr")]
    for r in records:
        assert r["identical"]  # float64: TR is exactly AR
        assert r["group"] == {"writing": "conversation", "qa": "qa"}[r["category"]]
        assert 1 <= r["new_tokens"] <= 8 and r["steps"] >= 0 and r["prefill_s"] > 0 and r["decode_s"] >= 0
        assert sum(r["accept_lengths"]) == r["new_tokens"] - 1  # the first token comes from the prefill
    summary = (out / "summary.md").read_text()
    assert "| tr |" in summary and "| conversation | qa | all |" in summary.replace("method | ", "")
    assert "DIFFERS" not in summary
    machine = json.loads((out / "machine.json").read_text())
    assert {"cpu", "cores", "threads", "torch", "commit"} <= set(machine)
    for png in ("speedup.png", "accept_lengths.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_specbench_adaptive_methods_report_their_tree_sizes(tiny_factory, tmp_path, monkeypatch):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "rag", "turns": ["a b c a b c a b c a b"]}) + "\n")
    out, home = tmp_path / "out", tmp_path / "home"
    monkeypatch.setenv("TR_ENGINE_HOME", str(home))
    proc = bench_main("bench.specbench", "--model", str(tiny_factory("bench", dtype=torch.float64)), "--dtype",
                      "float64", "--questions", str(questions), "--methods", "tr-adaptive", "hybrid", "hybrid-81",
                      "--max-new-tokens", "12", "--warmup", "1", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["ar", "tr-adaptive", "hybrid", "hybrid-81"]
    for r in records:
        assert r["identical"]
        assert len(r["verify_tokens"]) == r["steps"] and all(t >= 1 for t in r["verify_tokens"])
    # At the static tree's size whatever the cost: 80 tokens (the biggest bucket within 81), or a 64-token tree with
    # a prompt-lookup chain (charged as 80) where the chain is worth more than the tree's last 16 nodes.
    assert all(64 < t <= 80 for t in records[-1]["verify_tokens"][:-1])
    summary = (out / "summary.md").read_text()
    assert "Tokens per verify" in summary and "| hybrid |" in summary and "tree_sizes.png" in summary
    assert (out / "tree_sizes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Where the drafts came from: every draft node counts for the source(s) that proposed it.
    hybrid = records[2]
    drafted, accepted = (sum(hybrid[k]) - hybrid["steps"] for k in ("verify_tokens", "accept_lengths"))
    assert set(hybrid["by_source"]) == {"matrix", "lookup", "suffix"} and hybrid["by_source"]["matrix"][0] > 0
    assert sum(d for d, _ in hybrid["by_source"].values()) >= drafted > 0
    assert sum(a for _, a in hybrid["by_source"].values()) >= accepted
    assert "Draft tokens by source" in summary and "| hybrid | matrix |" in summary
    # Calibrated once, shared by every adaptive method; cached unless measured through a noisy spell (then said so).
    from tr_engine.cli.args import CalibrationNotice

    assert proc.stderr.count(CalibrationNotice.TEXT) == 1, proc.stderr
    cached = "the verify cost was not cached" not in proc.stderr
    assert len(list((home / "costs").glob("*.json"))) == int(cached), proc.stderr


def test_specbench_sampling_uses_one_seed_per_turn_for_every_method(tiny_factory, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n"
                                 for i, t in enumerate(["Who are you?", "Say something.", "Why?"])))
    out = tmp_path / "out"
    args = ("bench.specbench", "--model", str(tiny_factory("bench", dtype=torch.float64)), "--dtype", "float64",
            "--questions", str(questions), "--methods", "tr", "pld", "--max-new-tokens", "10", "--warmup", "1",
            "--threads", "1", "--temperature", "0.9", "--top-p", "0.95", "--seed", "4")
    proc = bench_main(*args, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all(r["identical"] for r in records)  # float64, same draws: every method samples plain sampling's tokens
    summary = (out / "summary.md").read_text()
    assert "sampled (temperature 0.9, top-p 0.95" in summary and "over our own plain sampling" in summary
    assert "geo-mean" in summary
    again = tmp_path / "again"
    assert bench_main(*args, "--out", str(again)).returncode == 0
    tokens = lambda d: [r["new_tokens"] for r in map(json.loads, (d / "results.jsonl").read_text().splitlines())]  # noqa: E731
    assert tokens(again) == tokens(out)  # seeded: the run repeats
    refused = bench_main(*args, "--methods", "hf-ar", "--out", str(tmp_path / "x"))
    assert refused.returncode == 2 and "greedy only" in refused.stderr


def test_kernels_bench_at_the_tiny_shape(tmp_path):
    """bench.kernels with a shape and a CPU tier below this machine's best: every op's row, on that tier, with the
    file named after the shape and the tier."""
    proc = run_module("bench.kernels", "--shape", "tiny", "--tier", "scalar", "--reps", "1", "--threads", "1", "--out",
                      str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    stem = "kernels_cpu_tiny_scalar"
    assert "kernel tier scalar" in (tmp_path / f"{stem}.md").read_text()
    rows = json.loads((tmp_path / f"{stem}.json").read_text())["rows"]
    assert {r["op"] for r in rows} == {"tree_attention", "recycle_update_", "compact_kv_", "skinny_linear",
                                       "packed_linear"}
    assert all(r["ours_ms"] > 0 and r["stock_ms"] > 0 and r["reference_ms"] > 0 for r in rows)
    assert all(r["gb_s"] == pytest.approx(r["bytes"] / r["ours_ms"] / 1e6) and r["of_peak"] > 0 for r in rows)
    assert "(tiny shapes)" in (tmp_path / f"{stem}.md").read_text()
    # The matmuls' roofline: their FLOPs against the tier's multiply-add peak, the floor the larger of the two.
    matmuls = [r for r in rows if r["op"].endswith("_linear") and "projections" in r["shape"]]
    assert matmuls and all("gflops" not in r for r in rows if r not in matmuls)
    for r in matmuls:
        T = int(r["shape"].split(",")[0].removeprefix("T="))
        assert r["flops"] == 2 * T * sum(n * k for n, k in projections(SHAPES["tiny"]))
        assert r["gflops"] == pytest.approx(r["flops"] / r["ours_ms"] / 1e6)
        assert r["of_fma"] == pytest.approx(r["gflops"] / r["fma_gflops"])
        floors = {"memory": r["bytes"] / r["read_gb_s"] / 1e6, "compute": r["flops"] / r["fma_gflops"] / 1e6}
        assert r["bound"] == max(floors, key=floors.get)
        assert r["floor_ms"] == pytest.approx(floors[r["bound"]]) and r["of_floor"] == pytest.approx(
            r["floor_ms"] / r["ours_ms"])
    # Each dtype against its own peak: bf16 against the tier's bf16 arithmetic (the pair dot product where it has it),
    # float32 and float16 against the float multiply-add; both named in the header.
    peaks = {r["bf16_peak"]: r["fma_gflops"] for r in matmuls}
    assert set(peaks) == {False, True}
    assert all(r["bf16_peak"] == r["shape"].endswith("bfloat16") and r["fma_gflops"] == peaks[r["bf16_peak"]]
               for r in matmuls)
    text = (tmp_path / f"{stem}.md").read_text()
    assert f"{peaks[False]:.0f} GFLOPS for float32 and float16" in text
    assert f"{peaks[True]:.0f} GFLOPS for bfloat16" in text


def test_kernels_bench_takes_its_shapes_from_a_model(tiny_factory, tmp_path):
    folder = tiny_factory("kernels-shapes", num_heads=4, num_kv_heads=1, head_dim=32, vocab_size=300)
    proc = run_module("bench.kernels", "--model", str(folder), "--only", "tree_attention", "recycle_update_",
                      "--reps", "1", "--threads", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    [out] = tmp_path.glob(f"kernels_cpu_{folder.name}*.json")  # (_<tier> after the name when TR_ENGINE_CPU forces one)
    rows = json.loads(out.read_text())["rows"]
    assert any("4q/1kv heads, D=32" in r["shape"] for r in rows) and any("V=300" in r["shape"] for r in rows)
    assert_one_line_error(run_module("bench.kernels", "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path)),
                          "nowhere")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: nothing is missing")
def test_kernels_bench_on_a_missing_gpu_is_one_line(tmp_path):
    assert_one_line_error(run_module("bench.kernels", "--device", "cuda", "--out", str(tmp_path)), "no CUDA device")


def test_ab_interleaves_two_checkouts(tiny_factory, tmp_path):
    """bench.ab with this checkout on both sides: two warm workers, the same questions alternately, the same tokens."""
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"Say {c} things."]}) + "\n"
                                 for i, c in enumerate(["writing", "qa", "rag"])))
    out = tmp_path / "ab" / "run"
    repo = str(Path(__file__).parents[1])
    proc = run_module("bench.ab", "--before", repo, "--after", repo, "--model", str(tiny_factory("bench-ab")),
                      "--dtypes", "float32", "--questions", "3", "--questions-file", str(questions),
                      "--max-new-tokens", "6", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.with_suffix(".json").read_text())["float32"]
    assert data["questions"] == 3 and data["identical"] == 3
    assert [r["question_id"] for r in data["rows"]] == [0, 1, 2]
    assert all(r["before_s"] > 0 and r["after_s"] > 0 and 1 <= r["after_tokens"] == r["before_tokens"] <= 6
               for r in data["rows"])
    # each side's speed over its own tokens (answers part where the sides round differently)
    for side in ("before", "after"):
        assert data["tokens_per_s"][side] == pytest.approx(sum(r[f"{side}_tokens"] for r in data["rows"]) /
                                                           sum(r[f"{side}_s"] for r in data["rows"]))
    # the split of the ratio: forwards summed over the questions, each forward verifying at least its root
    for side in ("before", "after"):
        assert data["forwards"][side] == sum(r[f"{side}_forwards"] for r in data["rows"]) > 0
        assert all(r[f"{side}_verified"] >= r[f"{side}_forwards"] for r in data["rows"])
        assert data["curves"][side]["relative"][0][0] == 1.0  # each side's curve, in its plain steps
        # and the prompts' prefill apart from the decode (a change to prompt chunks shows there)
        assert data["prefill_s"][side] == pytest.approx(sum(r[f"{side}_s"] - r[f"{side}_decode_s"]
                                                            for r in data["rows"])) and data["prefill_s"][side] > 0
    assert "| float32 |" in out.with_suffix(".md").read_text() and "3/3 |" in proc.stdout
    # with --shared-curve both sides plan from the after side's curve
    proc = run_module("bench.ab", "--before", repo, "--after", repo, "--model", str(tiny_factory("bench-ab")),
                      "--dtypes", "float32", "--questions", "3", "--questions-file", str(questions),
                      "--max-new-tokens", "6", "--threads", "1", "--out", str(out), "--shared-curve")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.with_suffix(".json").read_text())["float32"]
    assert data["curves"]["before"] == data["curves"]["after"] and data["identical"] == 3
    assert "the cost curve the after side measured" in out.with_suffix(".md").read_text()
    # with --curve FILE both plan with the file's curve (a cached one's format), whatever they would measure
    given = {"buckets": data["curves"]["after"]["sizes"], "prefixes": data["curves"]["after"]["prefixes"],
             "relative": [[1.0 + 0.5 * i for i in range(len(data["curves"]["after"]["sizes"]))]] * 2,
             "plain_s": data["curves"]["after"]["plain_s"], "key": {}}
    (tmp_path / "curve.json").write_text(json.dumps(given))
    proc = run_module("bench.ab", "--before", repo, "--after", repo, "--model", str(tiny_factory("bench-ab")),
                      "--dtypes", "float32", "--questions", "3", "--questions-file", str(questions),
                      "--max-new-tokens", "6", "--threads", "1", "--out", str(out),
                      "--curve", str(tmp_path / "curve.json"))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.with_suffix(".json").read_text())["float32"]
    assert data["curves"]["before"]["relative"] == data["curves"]["after"]["relative"] == given["relative"]
    # each side on a CPU kernel tier of its own (one checkout on two tiers)
    proc = run_module("bench.ab", "--before", repo, "--after", repo, "--model", str(tiny_factory("bench-ab")),
                      "--dtypes", "float32", "--questions", "1", "--questions-file", str(questions),
                      "--max-new-tokens", "4", "--threads", "1", "--out", str(out), "--before-tier", "scalar")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.with_suffix(".json").read_text())["float32"]
    assert data["tiers"] == {"before": "scalar", "after": cpu.choose().name}  # (TR_ENGINE_CPU too)
    # the header names both sides' tiers, the one it chose as well as the forced one
    assert f"on the scalar tier) and after ({describe(Path(repo))} on the {cpu.choose().name} tier)" in (
        out.with_suffix(".md").read_text())
    proc = run_module("bench.ab", "--before", repo, "--after", repo, "--model", str(tiny_factory("bench-ab")),
                      "--dtypes", "float32", "--questions", "1", "--questions-file", str(questions),
                      "--max-new-tokens", "2", "--threads", "1", "--out", str(out), "--after-tier", "scalar")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.with_suffix(".json").read_text())["float32"]["tiers"]["after"] == "scalar"
    assert "kernel tier scalar" in out.with_suffix(".md").read_text()  # the machine line: the after side's tier
    bad = run_module("bench.ab", "--before", repo, "--after-tier", "avx1024", "--out", str(out))
    assert_one_line_error(bad, "unknown CPU tier 'avx1024'")
    (tmp_path / "curve.json").write_text("{}")
    bad = run_module("bench.ab", "--before", repo, "--curve", str(tmp_path / "curve.json"), "--out", str(out))
    assert_one_line_error(bad, "curve.json", "not a cost curve file")
    bad = run_module("bench.ab", "--before", str(tmp_path / "nowhere"), "--out", str(out))
    assert_one_line_error(bad, "nowhere", "not a tr-engine checkout")


def test_ab_compares_two_checkouts_batched_round_by_round(tiny_factory, tmp_path):
    """bench.ab --batch: each side warms on other questions, then answers all of them at once, round after round
    from that warm state, the sides alternating: the same tokens every round, and both sides alike."""
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"Say {i} things."]})
                                 + "\n" for i in range(8)))
    out, repo = tmp_path / "ab" / "batch", str(Path(__file__).parents[1])
    proc = run_module("bench.ab", "--before", repo, "--after", repo, "--model", str(tiny_factory("bench-ab")),
                      "--dtypes", "float32", "--questions", "3", "--questions-file", str(questions),
                      "--max-new-tokens", "6", "--threads", "1", "--out", str(out), "--batch", "2", "--rounds", "3",
                      "--shared-curve")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.with_suffix(".json").read_text())
    run = data["float32"]
    assert data["batch"] == 2 and data["rounds"] == 3
    assert run["questions"] == 9 and run["identical"] == 9  # three requests a round
    assert [r["group"] for r in run["rows"]] == ["round 1", "round 2", "round 3"]
    tokens = {r["after_tokens"] for r in run["rows"]} | {r["before_tokens"] for r in run["rows"]}
    assert len(tokens) == 1 and 3 <= tokens.pop() <= 18  # lossless: every round, every request its plain answer
    assert all(r["after_verified"] >= r["after_forwards"] >= 3 for r in run["rows"])  # sequence-steps
    assert "up to 2 a forward), 3 rounds" in out.with_suffix(".md").read_text()
    bad = run_module("bench.ab", "--before", repo, "--batch", "0", "--out", str(out))
    assert_one_line_error(bad, "--batch")


@pytest.mark.slow
def test_batch_bench_on_a_tiny_model(tiny_factory, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"Question {i}?"]}) + "\n"
                                 for i in range(3)))
    proc = bench_main("bench.batch", "--model", str(tiny_factory("bench-batch")), "--dtypes", "float32",
                      "--questions", "2", "--warmup", "1", "--questions-file", str(questions), "--max-new-tokens", "5",
                      "--threads", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "batch.json").read_text())["float32"]
    assert set(rows) == {f"{m}@{s}" for m in ("ar", "tr", "hybrid", "pld") for s in (1, 2, 4, 8, 16)}
    assert all(r["identical"] == 2 and r["tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in rows.values())
    assert rows["ar@1"]["speedup"] == 1.0 and rows["hybrid@4"]["speedup_same_batch"] == pytest.approx(
        rows["hybrid@4"]["tokens_per_s"] / rows["ar@4"]["tokens_per_s"])
    assert (tmp_path / "batch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    warm = tmp_path / "w.jsonl"  # a file with warm-up rows of its own, a suffix index, two methods, three sizes
    warm.write_text(questions.read_text() + json.dumps({"question_id": "w", "category": "qa", "turns": ["Hello?"],
                                                        "warmup": True}) + "\n")
    proc = bench_main("bench.batch", "--model", str(tiny_factory("bench-batch")), "--dtypes", "float32",
                      "--questions", "3", "--questions-file", str(warm), "--max-new-tokens", "5", "--threads", "1",
                      "--methods", "ar", "hybrid", "--sizes", "1", "2", "4", "--suffix-index", "1", "--name", "mem",
                      "--rounds", "3", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "mem.json").read_text())["float32"]
    assert set(rows) == {f"{m}@{s}" for m in ("ar", "hybrid") for s in (1, 2, 4)}
    assert all(r["identical"] == 3 for r in rows.values())  # (in every round)
    for r in rows.values():  # each row is its median round's
        assert len(r["rounds_tokens_per_s"]) == 3 and r["tokens_per_s"] == sorted(r["rounds_tokens_per_s"])[1]
    text = (tmp_path / "mem.md").read_text()
    assert "3 questions of w.jsonl" in text and "the median of 3 rounds" in text


def test_dtypes_bench_sets_each_half_type_against_float32(tiny_factory, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"Question {i}?"]}) + "\n"
                                 for i in range(3)))
    proc = bench_main("bench.dtypes", "--model", str(tiny_factory("bench-dtypes")), "--dtypes", "float32", "bfloat16",
                      "--questions", "2", "--warmup", "1", "--questions-file", str(questions), "--max-new-tokens", "6",
                      "--threads", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / f"dtypes_{cpu.active()}.json").read_text())
    assert data["machine"]["cpu_tier"] == cpu.active() and data["questions"] == 2 and data["warmup"] == 1
    fp32, bf16 = data["rows"]["float32"], data["rows"]["bfloat16"]
    assert fp32["identical_to_float32"] == 2 and fp32["agreeing_tokens"] == fp32["float32_tokens"]
    assert 0 <= bf16["identical_to_float32"] <= 2 and 0 <= bf16["agreeing_tokens"] <= bf16["float32_tokens"]
    assert fp32["lossless"] == bf16["lossless"] == 2  # every method commits its dtype's plain answer
    assert all(r["ar_tokens_per_s"] > 0 and r["hybrid_tokens_per_s"] > 0 for r in (fp32, bf16))
    assert "| bfloat16 |" in (tmp_path / f"dtypes_{cpu.active()}.md").read_text()


def test_prefill_stall_compares_whole_and_chunked_prompts_joining_a_batch(tiny_factory, tmp_path):
    proc = bench_main("bench.prefill_stall", "--model", str(tiny_factory("bench-stall")), "--dtype", "float32",
                      "--prompt-tokens", "120", "--chunks", "0", "16", "--max-new-tokens", "16", "--after", "2",
                      "--rounds", "2", "--threads", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "prefill_stall.json").read_text())
    whole, chunked = record["median"]["0"], record["median"]["16"]
    assert record["prompt_tokens"] > 120 and whole["identical"] == chunked["identical"] == 4
    assert [len(record["runs"][c]) for c in ("0", "16")] == [2, 2]
    assert chunked["long_prefill_s"] > 0 and whole["first_token_s"] >= whole["long_prefill_s"]
    text = (tmp_path / "prefill_stall.md").read_text()
    assert "| whole |" in text and "| 16 |" in text and "the median of 2 runs" in text


def test_serve_bench_and_its_soak_on_a_tiny_model(tiny_factory, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"Question {i}?"]}) + "\n"
                                 for i in range(4)))
    model = str(tiny_factory("bench-serve"))
    common = ("--model", model, "--dtype", "float32", "--questions-file", str(questions), "--max-new-tokens", "6",
              "--threads", "1", "--out", str(tmp_path))
    proc = run_module("bench.serve", *common, "--questions", "3", "--warmup", "1", "--clients", "2")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "serve.json").read_text())["rows"]
    assert set(rows) == {"ar@2", "hybrid@2"}
    assert all(r["identical"] == 3 and r["tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0 for r in rows.values())
    proc = run_module("bench.serve", *common, "--soak", "--requests", "52", "--soak-clients", "4")
    assert proc.returncode == 0, proc.stderr
    soak = json.loads((tmp_path / "serve_soak.json").read_text())
    assert soak["failed"] == 0 and soak["exit_status"] == 0 and soak["matrix_loads"] is True, soak
    assert "verdict:" in (tmp_path / "serve_soak.md").read_text()
    # with a suffix index of the smallest bound, saved every half second and SIGKILLed at the end: what it saved loads
    proc = run_module("bench.serve", *common, "--soak", "--requests", "52", "--soak-clients", "4", "--suffix-index",
                      "1", "--save-every", "0.5", "--kill")
    assert proc.returncode == 0, proc.stderr
    soak = json.loads((tmp_path / "serve_soak_suffix.json").read_text())
    assert soak["exit_status"] == -9 and soak["matrix_loads"] is True and soak["index_within_bound"] is True, soak
    assert 0 <= (1 << 20) - soak["index_bound_bytes"] < 20 and soak["samples"][-1]["index_tokens"] > 0
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"Question {i}?", "And why?"]})
                           + "\n" for i in range(3)))
    proc = run_module("bench.serve", *common, "--multi-turn", "--questions-file", str(two), "--batch", "2")
    assert proc.returncode == 0, proc.stderr
    multi = json.loads((tmp_path / "serve_multi_turn.json").read_text())
    on, off = multi["modes"]["on"], multi["modes"]["off"]
    assert multi["conversations"] == 3 and multi["identical"] == multi["answers"] == 6, multi
    assert off["reused_counter"] == sum(off["cached_tokens"]) == 0
    # (the tiny model's answers are random bytes that do not survive text: at least the first turn is found again)
    assert on["reused_counter"] >= sum(on["cached_tokens"]) > 0 and all(c > 0 for c in on["cached_tokens"])


def test_forward_cost_at_a_shape_stands_the_step_against_its_floor_and_projects(tmp_path):
    """--shape builds a random model in memory (the tiny stand-in here; vicuna-7b in bench/results), measures the
    read bandwidth in the same run, and projects MAT(T) / cost(T) from bench/results/tree_mat.json."""
    proc = bench_main("bench.forward_cost", "--shape", "tiny", "--reps", "1", "--prefixes", "64", "--threads", "1",
                      "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    stem = tmp_path / f"forward_cost_tiny_bfloat16{tier_suffix(cpu.choose().name)}"  # (each tier's its own)
    got = json.loads(stem.with_suffix(".json").read_text())
    assert got["read_gb_s"] > 0 and got["floor_s"] == pytest.approx(got["step_weight_bytes"] / got["read_gb_s"] / 1e9)
    assert got["relative"]["64"]["1"] == 1.0 and set(got["relative"]["64"]) >= {"8", "16", "64"}
    tr = got["projection"]["methods"]["tr"]
    for T, row in tr.items():
        assert row["speedup"] == pytest.approx(row["mat"] / got["relative"]["64"][T])
    assert "Projected speedup" in stem.with_suffix(".md").read_text() and stem.with_suffix(".png").exists()
    # By category group: each group at its best measured size, and the geometric mean over the groups.
    measured = json.loads((Path(__file__).parents[1] / "bench" / "results" / "tree_mat.json").read_text())
    assert set(got["projection"]["by_group"]) == set(measured.get("mat_by_group", {}))
    for method, g in got["projection"]["by_group"].items():
        for group, best in g["groups"].items():
            speedups = {int(T): mat / got["relative"]["64"][T]
                        for T, mat in measured["mat_by_group"][method][group].items() if T in got["relative"]["64"]}
            assert best["speedup"] == pytest.approx(max(speedups.values())) and best["tokens"] == max(
                speedups, key=speedups.get)
        product = math.prod(b["speedup"] for b in g["groups"].values())
        assert g["geo_mean"] == pytest.approx(product ** (1 / len(g["groups"])))


def test_tree_mat_measures_each_size_and_category_group(tiny_factory, tmp_path):
    """The harness behind bench/results/tree_mat.md on a tiny model: MAT by size for each method, pooled and by
    category group, every output checked against plain decoding (the run fails otherwise)."""
    folder = tiny_factory("long", max_positions=8192)  # (a RAG question is ~2400 of its tokens)
    proc = bench_main("bench.tree_mat", "--model", str(folder), "--dtype", "float32", "--per-group", "1",
                      "--max-new-tokens", "8", "--sizes", "4", "8", "--methods", "tr", "hybrid", "hybrid-suffix",
                      "--threads", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "tree_mat.json").read_text())
    assert got["sizes"] == [4, 8] and set(got["mat"]) == set(got["mat_by_group"]) == {"tr", "hybrid", "hybrid-suffix"}
    for method, by_group in got["mat_by_group"].items():
        assert len(by_group) == 6  # one question of each category group
        assert all(mat >= 1.0 for by_T in by_group.values() for mat in by_T.values())
    assert "hybrid by category group" in (tmp_path / "tree_mat.md").read_text()
    bad = bench_main("bench.tree_mat", "--sizes", "9", "--out", str(tmp_path))
    assert bad.returncode == 2 and "--sizes must be verify buckets" in bad.stderr


def test_threads_compares_the_policies_idle_and_beside_a_busy_process(tiny_factory, tmp_path):
    """The harness behind bench/results/threads.md on a tiny model: each method under each thread policy, idle and
    beside a busy process (started and stopped by the bench), every policy's tokens the same."""
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n"
                                 for i, t in enumerate(["Who are you?", "Write a line about the sea."])))
    proc = bench_main("bench.threads", "--model", str(tiny_factory()), "--dtype", "float32", "--questions", "2",
                      "--questions-file", str(questions), "--max-new-tokens", "4", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "threads.json").read_text())["results"]
    assert set(got) == {"idle/ar", "idle/hybrid", "busy/ar", "busy/hybrid"}
    for row in got.values():
        assert set(row["median_tok_s"]) == {"all", "follow", "one"} and row["identical"] == 2
        assert all(1 <= n <= torch.get_num_threads() for n in row["follow_threads"])
    assert "| busy | hybrid |" in (tmp_path / "threads.md").read_text()


def test_load_memory_writes_a_checkpoint_of_a_shape_loads_it_and_reports(tmp_path):
    """The harness behind bench/results/load_memory_vicuna-7b.md at the tiny shape (where memory ratios mean
    nothing: tests/test_weights.py holds loading to its memory at 100 MB)."""
    scratch = tmp_path / "scratch"  # (made where missing)
    proc = run_module("bench.load_memory", "--shape", "tiny", "--stored", "float16", "--scratch", str(scratch),
                      "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "out" / "load_memory_tiny.json").read_text())["rows"]["float16"]
    assert got["checkpoint_bytes"] > 0 and got["held_bytes"] > 0 and got["load_s"] > 0
    assert got["peak_bytes"] >= got["grown_bytes"]
    assert "| float16 |" in (tmp_path / "out" / "load_memory_tiny.md").read_text()
    assert not any(scratch.iterdir())  # the checkpoint and its temporary folder are gone
    (tmp_path / "a-file").write_text("")
    bad = run_module("bench.load_memory", "--shape", "tiny", "--scratch", str(tmp_path / "a-file" / "below"),
                     "--out", str(tmp_path / "out"))
    assert_one_line_error(bad, "--scratch", "a-file", "cannot make a folder there")


def test_chat_shape_runs_the_chat_command_on_a_random_checkpoint_of_a_shape(tmp_path):
    """The harness behind bench/results/chat_shape_vicuna-7b.md at the tiny shape: both chats answer both turns,
    the default one measures its cost curve first, and memory is read from the live process."""
    scratch = tmp_path / "scratch" / "deeper"  # (made where missing)
    proc = run_module("bench.chat_shape", "--shape", "tiny", "--max-new-tokens", "6", "--scratch", str(scratch),
                      "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "out" / f"chat_shape_tiny{tier_suffix(cpu.choose().name)}.json").read_text())
    assert 300 <= got["tokenizer_pieces"] <= 1024  # the tiny shape's vocabulary bounds the trained pieces
    ar, default = got["runs"]["ar"], got["runs"]["default"]
    assert [t["method"] for t in ar["turns"]] == ["ar", "ar"] and [t["method"] for t in default["turns"]] == [
        "hybrid", "hybrid"]
    assert ar["notice_s"] is None and 0 < default["notice_s"] < default["first_byte_s"]
    for r in (ar, default):
        assert 0 < r["rss_after_load_bytes"] <= r["peak_bytes"] and all(t["tokens"] > 0 for t in r["turns"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "scratch"] and not any(scratch.iterdir())
    (tmp_path / "a-file").write_text("")
    bad = run_module("bench.chat_shape", "--shape", "tiny", "--scratch", str(tmp_path / "a-file" / "below"),
                     "--out", str(tmp_path / "out"))
    assert_one_line_error(bad, "--scratch", "a-file", "cannot make a folder there")


FAKE_LLAMA = """#!/bin/sh
# A stand-in for a llama.cpp tool: its timing lines on stderr, as the real one prints them.
case "$0" in
  *completion) echo "common_perf_print: prompt eval time =      40.00 ms /    42 tokens (    0.95 ms per token)" >&2
               echo "common_perf_print:        eval time =    1000.00 ms /   100 runs   (   10.00 ms per token)" >&2
               printf 'Paris is the capital.' ;;
  *lookup)     echo "encoded   42 tokens in    0.050 seconds, speed:  840.000 t/s" >&2
               echo "decoded  101 tokens in    0.800 seconds, speed:  126.250 t/s" >&2
               echo "n_drafted    = 40" >&2
               echo "n_accept     = 30" >&2
               printf '%s%s' "$4" 'Paris is the capital.' ;;
esac
"""


def test_peers_reads_llama_cpps_timings_and_sets_the_engines_side_by_side(tmp_path):
    """bench.peers without building llama.cpp: its output parsed from stand-in tools, then the table written from
    them and our rows, the ratios the acceptance reads computed from the totals."""
    from bench.peers import run_llama, split, summary, write

    for tool in ("llama-completion", "llama-lookup"):
        (tmp_path / tool).write_text(FAKE_LLAMA)
        (tmp_path / tool).chmod(0o755)
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    plain = run_llama(tmp_path, "llama-completion", tmp_path / "m.gguf", prompt, 128, 2)
    assert plain == dict(prompt_tokens=42, prefill_s=0.04, decode_tokens=100, decode_s=1.0,
                         text="Paris is the capital.")
    lookup = run_llama(tmp_path, "llama-lookup", tmp_path / "m.gguf", prompt, 128, 2, 3, tmp_path / "cache.bin")
    assert lookup["text"] == plain["text"] and (lookup["drafted"], lookup["accepted"]) == (40, 30)
    assert lookup["decode_tokens"] / lookup["decode_s"] == pytest.approx(126.25)
    lookup["same_text_as_plain"] = True

    def ours(tokens, seconds, steps):
        return dict(prompt_tokens=42, prefill_s=0.03, decode_tokens=tokens, decode_s=seconds, steps=steps,
                    same_tokens_as_plain=True)

    plain["bandwidth_gb_s"] = 26.9  # read beside the run: its floor 10 ms, its step 10 ms
    ar = dict(ours(100, 0.95, 100), bandwidth_gb_s=40.0)
    rows = {"llama.cpp": [plain], "llama.cpp lookup 3": [lookup], "ar": [ar],
            "hybrid": [ours(100, 0.5, 50)], "tr": [ours(100, 0.55, 52)], "pld": [ours(100, 0.8, 70)]}
    assert summary(rows["hybrid"])["mat"] == pytest.approx(101 / 51)
    data = {"questions": 1, "per_group": 1, "warm_up": 6, "max_new_tokens": 128, "threads": 2, "tier": "avx2",
            "llama_cpp_isa": ["-DGGML_AVX2=ON"], "llama_cpp_python": "0.3.36",
            "results": {"bfloat16": dict(weight_bytes=269_000_000,
                                                                       bandwidth_gb_s=[30.0, 40.0, 35.0],
                                                                       rows=rows)}}
    text = write(tmp_path / "out", data, {"cpu": "test", "cores": 2, "threads": 2, "torch": "x", "python": "y",
                                          "commit": "z"})
    assert "floor 7.69 ms/token" in text  # 269 MB at the median 35 GB/s
    assert "| llama.cpp | plain | 100.0 | 1.00x | 10.00 | 77% | 100% |" in text
    assert "| tr-engine | ar | 105.3 | 1.05x | 9.50 | 81% | 71% |" in text  # 269 MB at 40 GB/s: 6.7 of 9.5 ms
    assert "| tr-engine | hybrid | 200.0 | 2.00x | 5.00 |  |  |" in text
    assert "Best of ours (hybrid) / best of llama.cpp's (llama.cpp lookup 3): **1.58x**" in text
    assert "Plain against plain: **1.05x**" in text
    assert "for the avx2 instruction set" in text and "built with `-DGGML_AVX2=ON`; ours on the avx2 kernel" in text
    assert "text" not in json.loads((tmp_path / "out" / "peers_avx2.json").read_text())["results"]["bfloat16"]["rows"][
        "llama.cpp"][0]
    questions = [{"category": c} for c in ("writing", "translation", "writing", "translation", "qa")]
    warm, measured = split(questions, 1)
    assert warm == [questions[0], questions[1], questions[4]] and measured == [questions[2], questions[3]]


def test_step_profile_breaks_both_paths_down_on_a_tiny_model(tiny_factory, tmp_path):
    folder = tiny_factory("profile", dtype=torch.bfloat16, vocab_size=300, std=0.5, max_positions=8192)
    proc = bench_main("bench.step_profile", "--model", str(folder), "--dtypes", "bfloat16", "--prefix", "32",
                      "--reps", "3", "--rounds", "2", "--tokens", "6", "--threads", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "step_profile.json").read_text())["results"]["bfloat16"]
    for shape in ("plain step", "8-token verify"):
        parts = got["shapes"][shape]
        assert set(parts["forward"]) == {"module path (before)", "fused layers (after)"}
        assert all(ms > 0 for ms in (*parts["forward"].values(), parts["matmuls"], parts["attention"]))
    assert set(got["host"]) == {"module path (before)", "fused layers (after)"}
    text = (tmp_path / "step_profile.md").read_text()
    assert text.count("| plain step |") == 2 and text.count("| 8-token verify |") == 2


def test_a_missing_questions_file_is_a_user_error_not_an_internal_one(tmp_path):
    from bench.specbench import load_questions
    from tr_engine.errors import UserError

    with pytest.raises(UserError, match="none.jsonl does not exist"):
        load_questions(tmp_path / "none.jsonl", None, None)


def test_peers_starts_each_of_our_methods_on_a_question_from_the_same_matrix(markov_folder, monkeypatch):
    """Run in turn on one matrix, a later method would draft from rows just learned from the very answer it is asked
    for (tr after hybrid: MAT 1.94 against 1.42 from the same start): each method starts from the matrix the
    questions before left, and the default method's state is the one kept for the next question."""
    import bench.peers as peers
    from curves import pinned
    from tr_engine.engine import Engine
    from tr_engine.core.methods import DEFAULT_METHOD

    engine = pinned(Engine.from_pretrained(str(markov_folder), dtype="float64"))  # a cold matrix: any row learned shows
    monkeypatch.setattr(peers, "read_bandwidth", lambda reps=3: 10.0)
    starts, ends = {}, {}
    generate = engine.generate

    def recorded(question, max_new_tokens, method, **kwargs):
        starts[method] = engine.matrix.table.clone()
        result = generate(question, max_new_tokens, method=method, **kwargs)
        ends[method] = engine.matrix.table.clone()
        return result

    monkeypatch.setattr(engine, "generate", recorded)
    before = engine.matrix.table.clone()
    rows = peers.ours_in_turn(engine, "tell me a story", 48)
    assert list(rows) == list(peers.OURS) and all(r["same_tokens_as_plain"] for r in rows.values())
    assert all(torch.equal(start, before) for start in starts.values())
    assert not torch.equal(ends[DEFAULT_METHOD], before)  # it learned this answer, which the next must not see
    assert torch.equal(engine.matrix.table, ends[DEFAULT_METHOD])
    assert rows["ar"]["bandwidth_gb_s"] == 10.0 and rows["hybrid"]["steps"] < rows["ar"]["steps"]


def test_save_results_writes_the_report_and_its_numbers_with_the_machine_first(tmp_path):
    from bench.machine import save_results

    stem = tmp_path / "new" / "peers_avx2"  # a folder not made yet; a name that a suffix must not cut
    text = save_results(stem, "# report\n", {"rows": [1, 2]}, {"cpu": "x", "cpu_tier": "avx2"})
    assert text == "# report\n" and (tmp_path / "new" / "peers_avx2.md").read_text() == text
    data = json.loads((tmp_path / "new" / "peers_avx2.json").read_text())
    assert list(data) == ["machine", "rows"] and data["machine"]["cpu_tier"] == "avx2" and data["rows"] == [1, 2]



def test_the_memory_workload_is_what_its_script_writes(tmp_path):
    """bench/data/memory.jsonl: at least 50 measured requests in the four kinds, warm-up rows apart (none repeating a
    measured request), and the file bench.memory_workload writes (the instructions and the functions' names; a
    function's source may differ by a line in another Python)."""
    from bench.specbench import load_questions, warm_up_questions

    committed = Path(__file__).resolve().parents[1] / "bench" / "data" / "memory.jsonl"
    measured, warm = load_questions(committed, None, None), warm_up_questions(committed, 3)
    assert sum(len(q["turns"]) for q in measured) >= 50 and len(warm) == 8
    assert {q["category"] for q in measured} == {"extract", "edit", "faq", "follow-up"}
    asked = [t for q in measured for t in q["turns"]]
    assert not {t for q in warm for t in q["turns"][:1]} & set(asked)
    assert len(asked) - len(set(asked)) == 5 + 8 - 1  # the faq questions asked twice; the follow-ups' one line
    proc = run_module("bench.memory_workload", "--out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr

    def shape(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [(r["question_id"], r["category"], r.get("warmup", False),
                 [t.split("\n")[0] + t.split("def ")[1].split("(")[0] if "def " in t else t for t in r["turns"]])
                for r in rows]

    assert shape(tmp_path / "m.jsonl") == shape(committed)


@pytest.mark.parametrize("tier", [None, "scalar"])
def test_native_rows_times_each_row_count_against_one_from_cpp(tmp_path, tier):
    """bench.native_rows builds bench/native_rows.cpp, runs a shape's projections through the tier library from C++
    and writes every row count's times with one row's always among them (what the others stand against)."""
    proc = bench_main("bench.native_rows", "--shape", "tiny", "--dtypes", "bfloat16", "float32", "--rows", "3", "2",
                      "--reps", "2", "--threads", "2", "--out", str(tmp_path), *(["--tier", tier] if tier else []))
    assert proc.returncode == 0, proc.stderr
    name = tier or cpu.choose().name
    stem = tmp_path / f"native_rows_tiny_bfloat16_float32{tier_suffix(name)}"
    got = json.loads(stem.with_suffix(".json").read_text())
    assert got["machine"]["cpu_tier"] == name and got["rows"] == [1, 2, 3]
    assert got["machine"]["threads"] == 2
    for dtype in ("bfloat16", "float32"):
        ms = got["ms"][dtype]
        assert set(ms) == {"1", "2", "3"}
        assert all(0 < v["min_ms"] <= v["median_ms"] for v in ms.values()), ms
    text = stem.with_suffix(".md").read_text()
    assert f"kernel tier {name}" in text and "| 1 |" in text and "1.00 |" in text
    assert f"{len(projections(SHAPES['tiny']))} weights a pass" in text
