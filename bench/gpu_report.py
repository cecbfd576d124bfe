"""The GPU check's report: summary.md (the stage table, the headline numbers against the targets, the full curves)
and verify_cost.png, from the stages' records (bench/gpu_check.py)."""

from pathlib import Path

from bench.gpu_stages import HEADLINE_PREFIX

TARGETS = {"floor_share": 0.70, "verify81": 1.15}  # the targets: 7B fp16 plain step, 81-token verify

def summary(results: dict) -> str:
    st = results["stages"]
    rehearsal = results["rehearsal"]
    env = (st.get("env") or {}).get("results") or {}
    title = "CPU rehearsal of the GPU check" if rehearsal else f"GPU check on {env.get('gpu', 'a GPU')}"
    lines = [f"# {title}", ""]
    if env:
        lines.append(f"Machine: {env.get('gpu', env.get('cpu'))}"
                     + (f" (sm_{env['capability'].replace('.', '')}, {env['sms']} SMs, {env['memory_gib']} GiB)"
                        if "capability" in env else "")
                     + f"; torch {env.get('torch')}, CUDA {env.get('cuda_runtime')}, {env.get('nvcc') or 'no nvcc'}; "
                     f"Python {env.get('python')}; commit {env.get('commit')}.")
    lines.append(f"Total {results['total_s']:.0f} s of a {results['budget_s']:.0f}-second budget."
                 + (" Rehearsal: tiny shapes on the CPU; what needs CUDA is skipped and listed below." if rehearsal
                    else ""))
    lines += ["", "## Stages", "", "| stage | status | seconds | skipped | failures |", "|---|---|---|---|---|"]
    for name, s in st.items():
        lines.append(f"| {name} | {s['status']} | {s['seconds']:.1f} | {'; '.join(s['skipped']) or '-'} | "
                     f"{'; '.join(s['failures']) or '-'} |")
    lines += _headline(st, rehearsal)
    lines += _details(st)
    return "\n".join(lines) + "\n"


def _res(st: dict, name: str) -> dict:
    return (st.get(name) or {}).get("results") or {}


def _headline(st: dict, rehearsal: bool) -> list[str]:
    lines = ["", "## Headline", ""]
    b = _res(st, "build")
    if b:
        arch = b["arch_list"] or "the host CPU only"
        lines.append(f"- Build: {b['seconds']:.0f} s with {b['jobs']} jobs for {arch}; "
                     f"CUDA kernels: {', '.join(b['cuda_ops']) or 'none'}.")
    t = _res(st, "cuda-tests")
    if t:
        lines.append(f"- CUDA tests: {t['passed']} passed, {t['failures'] + t['errors']} failed, "
                     f"{t['skipped']} skipped "
                     f"of {t['tests']}.")
    bw = _res(st, "bandwidth")
    if bw:
        lines.append(f"- Copy bandwidth {bw['copy_gb_s']:.0f} GB/s; bf16 matmul {bw['bf16_matmul_tflops']:.1f} TFLOP/s "
                     f"({bw['matmul_n']}^3).")
    for shape in ("vicuna-7b", "smollm2"):
        r = _res(st, f"steps-{shape}")
        for dtype, row in (r.get("dtypes") or {}).items():
            for mode in ("eager", "graphs"):
                m = row[mode]
                floor = (f", {m['floor_share']:.0%} of the bandwidth floor ({m['floor_ms']:.3f} ms)"
                         if "floor_share" in m else "")
                target = ""
                if shape == "vicuna-7b" and dtype == "float16" and not rehearsal:
                    target = (f" [targets: floor share >= {TARGETS['floor_share']:.0%}, "
                              f"81-token verify <= {TARGETS['verify81']:.2f}x]")
                lines.append(f"- {r['shape']} {dtype} {mode}: plain step {m['plain_ms']:.3f} ms at prefix 512{floor}; "
                             f"81-token verify at prefix {HEADLINE_PREFIX} = {m['verify81']:.2f} plain steps{target}.")
    meth = _res(st, "methods")
    for mode, rows in meth.items():
        lines.append(f"- Methods ({mode}, tiny model): " + ", ".join(
            f"{m} {r['same_as_plain']}/{r['answers']} answers as plain's, MAT {r['mat']:.2f}" for m, r in rows.items())
            + ".")
    proj = _res(st, "projection")
    for key, row in (proj.get("rows") or {}).items():
        best = ", ".join(f"{m} {v:.2f}x at {T} tokens" for m, (T, v) in row["best"].items())
        lines.append(f"- Projected speedup ({key}): best {best}; static 2.2.2 {row['static_2_2_2']:.2f}x "
                     f"(the paper's MAT 2.70: {row['paper_2_2_2']:.2f}x).")
    return lines


def _details(st: dict) -> list[str]:
    lines = []
    for shape in ("vicuna-7b", "smollm2"):
        r = _res(st, f"steps-{shape}")
        for dtype, row in (r.get("dtypes") or {}).items():
            lines += ["", f"## Verify cost, {r['shape']} {dtype} (plain step = 1.00)", "",
                      "| tokens | " + " | ".join(f"eager P={P} | graphs P={P}" for P in r["prefixes"]) + " |",
                      "|---|" + "---|---|" * len(r["prefixes"])]
            for T in r["sizes"]:
                cells = [f"{row[mode]['relative'][str(P)][str(T)]:.2f}" for P in r["prefixes"]
                         for mode in ("eager", "graphs")]
                lines.append(f"| {T} | " + " | ".join(cells) + " |")
            lines.append("")
            lines.append("Plain step (ms): " + ", ".join(
                f"{mode} {row[mode]['seconds'][str(P)]['1'] * 1e3:.3f} at P={P}" for mode in ("eager", "graphs")
                for P in r["prefixes"]) + ".")
    proj = _res(st, "projection")
    if proj:
        lines += ["", f"## Projected speedup by tree size (MAT from {proj['mat_source']} / verify cost at prefix "
                  f"{HEADLINE_PREFIX})", ""]
        for key, row in proj["rows"].items():
            for method, by_T in row["projected"].items():
                lines.append(f"- {key}, {method}: " + ", ".join(f"{T}: {v:.2f}x" for T, v in by_T.items()))
    meth = _res(st, "methods")
    if meth:
        phases = ("retrieve", "verify", "accept", "compact", "recycle")
        lines += ["", "## Methods on a tiny random model (host ms per step by phase)", "",
                  "| mode | method | answers as plain's | MAT | decode s | vs plain | " + " | ".join(phases) + " |",
                  "|---|---|---|---|---|---|" + "---|" * len(phases)]
        for mode, rows in meth.items():
            for method, r in rows.items():
                ph = r.get("phase_ms_per_step", {})
                lines.append(f"| {mode} | {method} | {r['same_as_plain']}/{r['answers']} | {r['mat']:.2f} | "
                             f"{r['decode_s']:.3f} | {r['speedup']:.2f}x | "
                             + " | ".join(f"{ph[p]:.3f}" if p in ph else "-" for p in phases) + " |")
    k = _res(st, "kernels")
    for shape, rows in k.items():
        from bench.kernels import table

        lines += ["", f"## Kernels at {shape} shapes", "", *table(rows)]
    return lines


def plot(path: Path, stages: dict) -> None:
    curves = {}
    for shape in ("vicuna-7b", "smollm2"):
        r = _res(stages, f"steps-{shape}")
        for dtype, row in (r.get("dtypes") or {}).items():
            for mode in ("eager", "graphs"):
                curves[f"{r['shape']} {dtype} {mode}"] = row[mode]["relative"][str(HEADLINE_PREFIX)]
    if curves:
        from bench.forward_cost import plot as plot_curves

        plot_curves(path, curves, "Verify cost by tree size", f"cost / plain decode step (prefix {HEADLINE_PREFIX})")
