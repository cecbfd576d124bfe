"""The GPU check's rehearsal (bench/gpu_check.py on the CPU, tiny shapes): every stage runs end to end and the summary
lists each one with what it skipped, so the script cannot rot before a GPU is lent. And its time-boxing: a stage over
its limit is killed, recorded, and the next stage still runs."""

import json

import pytest
import torch

from bench import gpu_check
from bench.gpu_check import STAGES
from cli import assert_one_line_error, call_main, run_module


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = run_module("bench.gpu_check", "--device", "cpu", "--out", str(out), timeout=300)
    return proc, out


@pytest.mark.slow
def test_the_rehearsal_runs_every_stage(rehearsal):
    proc, out = rehearsal
    results = json.loads((out / "results.json").read_text())
    failed = {name: s["failures"] for name, s in results["stages"].items() if s["status"] != "ok"}
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert list(results["stages"]) == list(STAGES) and results["rehearsal"]
    stages = results["stages"]
    # What it measured, not just that it ran:
    assert stages["cuda-tests"]["results"]["tests"] >= 20  # the cuda-marked tests were collected (and skipped)
    assert stages["bandwidth"]["results"]["copy_gb_s"] > 0
    for shape in ("vicuna-7b", "smollm2"):
        row = stages[f"steps-{shape}"]["results"]["dtypes"]["bfloat16"]
        for mode in ("eager", "graphs"):
            assert row[mode]["plain_ms"] > 0 and 0 < row[mode]["floor_share"]
            assert set(row[mode]["relative"]["1024"]) == {str(T) for T in (1, 2, 4, 8, 16, 32, 48, 64, 80, 81, 96, 128)}
    methods = stages["methods"]["results"]
    assert set(methods) == {"eager", "graphs", "graphs bfloat16"}  # bf16 is exact on a CPU: required, not reported
    assert all(r["identical"] and r["answers"] == 4 for rows in methods.values() for r in rows.values())
    assert {r["op"] for r in stages["kernels"]["results"]["tiny"]} >= {"tree_attention", "recycle_update_",
                                                                     "compact_kv_", "skinny_linear", "packed_linear"}
    assert stages["projection"]["results"]["rows"]


@pytest.mark.slow
def test_the_summary_lists_every_stage_and_what_it_skipped(rehearsal):
    _, out = rehearsal
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# CPU rehearsal of the GPU check")
    for name in STAGES:
        assert f"| {name} | ok |" in summary
    for skipped in ("no CUDA device", "cuda-marked tests skipped", "graph capture", "the vicuna-7b shape and float16"):
        assert skipped in summary
    assert "## Headline" in summary and "Projected speedup" in summary
    assert (out / "verify_cost.png").stat().st_size > 1000
    assert "===== kernels" in (out / "log.txt").read_text()


def test_a_stage_over_its_limit_is_killed_and_the_next_still_runs(tmp_path):
    proc = run_module("bench.gpu_check", "--device", "cpu", "--out", str(tmp_path), "--only", "bandwidth",
                      "projection", "--limit", "bandwidth=0.5", timeout=120)
    results = json.loads((tmp_path / "results.json").read_text())
    assert proc.returncode == 1
    assert results["stages"]["bandwidth"]["status"] == "timed out"
    assert results["stages"]["projection"]["status"] == "failed"  # it ran, and says what it lacked
    assert "steps-vicuna-7b stage left no verify curve" in results["stages"]["projection"]["failures"][0]
    assert "| bandwidth | timed out |" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("args,message", [
    pytest.param(["--device", "cuda", "--out", "x"], "no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: nothing is missing")),
    (["--device", "cpu"], "--out DIR is required"),
    (["--device", "cpu", "--out", "x", "--budget", "5"], "--budget 5 is outside"),
    (["--device", "cpu", "--out", "x", "--limit", "nonsense"], "--limit"),
    (["--device", "cpu", "--out", "x", "--limit", "build=-1"], "--limit"),
])
def test_bad_flags_are_one_line(args, message):
    assert_one_line_error(call_main(gpu_check.main, *args), message)
