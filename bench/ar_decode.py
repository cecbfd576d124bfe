"""Plain greedy decoding, ours against Hugging Face transformers' greedy `generate`, side by side in one run.

Same model (SmolLM2-135M-Instruct by default), prompts, machine, threads and dtype; both decode exactly
--max-new-tokens tokens (EOS ignored) and the token ids are checked equal, so the ratio compares like with like.
Methods alternate prompt by prompt, so machine noise hits both alike. Writes bench/results/ar_decode.{json,md}.

    python -m bench.ar_decode [--dtypes float32 bfloat16] [--prompts 4] [--max-new-tokens 128] [--threads 2]
"""

import json
import statistics
import time
from pathlib import Path

import torch

from bench.machine import machine_info, machine_line, save_results
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.core.decode import plain_generate
from tr_engine.engine import Engine

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_dev.jsonl"
FALLBACK_PROMPTS = [
    "What is the capital of France? Answer in one paragraph.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Summarize the plot of Romeo and Juliet.",
    "Explain how a hash table works to a new programmer.",
]


def load_prompts(path: Path, n: int) -> list[str]:
    if not path.is_file():
        return FALLBACK_PROMPTS[:n]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    step = max(len(rows) // n, 1)  # spread over the categories rather than taking the first n
    return [rows[i]["turns"][0] for i in range(0, len(rows), step)][:n]


def run_ours(engine: Engine, ids: list[int], n: int) -> tuple[list[int], float]:
    engine.cache.reset()
    t0 = time.perf_counter()
    gen = plain_generate(engine.model, engine.cache, ids, n, eos_ids=())
    return gen.token_ids, time.perf_counter() - t0


def run_hf(model, ids: list[int], n: int) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def bench_dtype(folder: Path, dtype: str, prompts: list[str], n: int) -> dict:
    from transformers import AutoModelForCausalLM

    engine = Engine.from_pretrained(str(folder), dtype=dtype, max_context=2048)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None  # decode exactly n tokens, like ours with eos_ids=()
    all_ids = [engine.prompt_ids(p) for p in prompts]
    run_ours(engine, all_ids[0], 8), run_hf(hf, all_ids[0], 8)  # warm-up
    rows = []
    for ids in all_ids:
        ours_tokens, ours_s = run_ours(engine, ids, n)
        hf_tokens, hf_s = run_hf(hf, ids, n)
        agree = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b), n)
        rows.append({"prompt_tokens": len(ids), "ours_tok_s": n / ours_s, "hf_tok_s": n / hf_s,
                     "same_tokens": ours_tokens == hf_tokens, "agreeing_prefix": agree})
    ours = statistics.mean(r["ours_tok_s"] for r in rows)
    theirs = statistics.mean(r["hf_tok_s"] for r in rows)
    return {"dtype": dtype, "ours_tok_s": ours, "hf_tok_s": theirs, "speedup": ours / theirs,
            "same_tokens": sum(r["same_tokens"] for r in rows), "prompts": len(rows),
            "agreeing_prefix": statistics.mean(r["agreeing_prefix"] for r in rows), "rows": rows}


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.ar_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)

    from tr_engine.model.folders import resolve_model

    torch.set_num_threads(args.threads)
    info = machine_info()  # before the run: the commit that produced the numbers
    folder = resolve_model(args.model)
    prompts = load_prompts(args.questions, args.prompts)
    results = [bench_dtype(folder, d, prompts, args.max_new_tokens) for d in args.dtypes]
    lines = [
        "# Plain greedy decoding: tr_engine vs transformers `generate`",
        "",
        f"Model {args.model}, {len(prompts)} prompts (chat template), {args.max_new_tokens} new tokens each, "
        f"EOS ignored, mean of per-prompt tokens/s (prefill included).",
        f"Machine: {machine_line(info)}.",
        "",
        "| dtype | tr_engine tok/s | transformers tok/s | speedup | identical outputs | tokens agreeing before the first difference (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['dtype']} | {r['ours_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['same_tokens']}/{r['prompts']} | {r['agreeing_prefix']:.0f} of {args.max_new_tokens} |")
    lines += ["", "bfloat16 and float16 outputs may differ: the two implementations round differently (matmul "
              "accumulation order, RoPE and norm casts), and half-precision rounding flips near-tied argmaxes; float32 "
              "outputs must be identical."]
    table = "\n".join(lines) + "\n"
    save_results(args.out / "ar_decode", table, {"args": {k: str(v) for k, v in vars(args).items()},
                                                 "results": results}, info)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
