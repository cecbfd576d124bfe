"""Where a plain decode step and an 8-token verify go, against the floor, with the decoder layers as one op each (the
fused path, Llama.fused_layers) and as the module path's PyTorch ops (before the fused op), measured in alternation on
one engine. Writes bench/results/step_profile.{md,json}.

    python -m bench.step_profile [--dtypes bfloat16 float32] [--prefix 256] [--reps 60] [--threads 2]

The parts of a forward at T rows (1 for a plain step; 8, a chain as a tree mask, for a verify):
  - floor: the bytes of weights the forward streams / this machine's read bandwidth (bench.machine.read_bandwidth);
  - weight matmuls above the floor: the forward's 4 projections per layer and the LM head, run alone in the same
    order at the same T (packed_linear), minus the floor: arithmetic, and streaming slower than the bandwidth;
  - attention: tree_attention alone over every layer's cache at the prefix;
  - glue: the forward minus those: RMSNorm, RoPE, the cache write, SiLU * up, residual adds, op dispatch, Python;
  - host: a plain step's engine time per token minus its forward (argmax, the loop); for a verify, the hybrid
    method's retrieve + accept + compact + recycle per step, from a generation's phase clock.
"""

import json
import statistics
import time
from pathlib import Path

import torch

from bench.machine import machine_info, machine_line, read_bandwidth
from bench.peers import weight_bytes
from bench.specbench import DEFAULT_QUESTIONS, load_questions
from tr_engine.cli import ArgumentParser, run
from tr_engine.engine import Engine
from tr_engine.models import DEFAULT_MODEL

PATHS = {"module path (before)": False, "fused layers (after)": True}
SHAPES = {"plain step": 1, "8-token verify": 8}


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def parts(engine: Engine, prefix: int, T: int, reps: int) -> dict:
    """Milliseconds of the forward (each path), its matmuls and its attention at T rows after `prefix` tokens."""
    model, cache = engine.model, engine.cache
    ops, data = model.ops, cache.data
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (prefix,)), torch.arange(prefix), data, 0)
        tokens, positions = torch.randint(0, model.config.vocab_size, (T,)), prefix + torch.arange(T)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        forward = {}
        for _ in range(3):  # the two paths in alternation, the best of three rounds each
            for name, fused in PATHS.items():
                model.fused_layers = fused
                ms = median_ms(lambda: model(tokens, positions, data, prefix, tree_mask=mask), reps)
                forward[name] = min(forward.get(name, ms), ms)
        model.fused_layers = True
        E = model.config.hidden_size
        cfg = model.local_config
        x = torch.randn(T, E).to(model.dtype)
        o_in = torch.randn(T, cfg.num_attention_heads * cfg.head_dim).to(model.dtype)
        down_in = torch.randn(T, cfg.intermediate_size).to(model.dtype)

        def matmuls():
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                ops.linear(x, a.qkv_weight), ops.linear(o_in, a.o_weight)
                ops.linear(x, m.gate_up_weight), ops.linear(down_in, m.down_weight)
            ops.linear(x, model.head_weight)

        q = torch.randn(T, cfg.num_attention_heads, cfg.head_dim).to(model.dtype)

        def attention():
            for kv in data:
                ops.tree_attention(q, kv[0], kv[1], prefix, mask, cfg.head_dim**-0.5)

        return dict(forward=forward, matmuls=median_ms(matmuls, reps), attention=median_ms(attention, reps))


def host_ms(engine: Engine, questions: list[dict], tokens: int) -> dict:
    """A plain step's engine time per token, and hybrid's work outside its verify forward per step."""
    plain_s, plain_steps, other_s, spec_steps = 0.0, 0, 0.0, 0
    for q in questions:
        g = engine.generate(q["turns"][0], max_new_tokens=tokens, method="ar", reuse_cache=False).generation
        plain_s, plain_steps = plain_s + g.decode_s, plain_steps + g.steps
        g = engine.generate(q["turns"][0], max_new_tokens=tokens, method="hybrid", reuse_cache=False).generation
        other_s += sum(s for name, s in g.phase_s.items() if name != "verify")
        spec_steps += g.steps
    return dict(plain_step=1e3 * plain_s / plain_steps, spec_other=1e3 * other_s / spec_steps)


def measure(args) -> dict:
    questions = load_questions(DEFAULT_QUESTIONS, None, None, per_group=1)
    results = {}
    for dtype in args.dtypes:
        engine = Engine.from_pretrained(DEFAULT_MODEL, dtype=dtype, threads=args.threads, max_context=2048)
        bw = [read_bandwidth()]
        shapes = {name: parts(engine, args.prefix, T, args.reps) for name, T in SHAPES.items()}
        bw.append(read_bandwidth())
        host = {}
        for name, fused in PATHS.items():
            engine.model.fused_layers = fused
            host[name] = host_ms(engine, questions, args.tokens)
        engine.model.fused_layers = True
        results[dtype] = dict(bandwidth_gb_s=bw, weight_bytes=weight_bytes(engine), shapes=shapes, host=host)
    return {"prefix": args.prefix, "reps": args.reps, "tokens": args.tokens, "results": results}


def write(out: Path, data: dict, info: dict) -> str:
    lines = ["# A plain step and an 8-token verify, part by part", "",
             f"Machine: {machine_line(info)}. SmolLM2-135M-Instruct, prefix {data['prefix']} tokens, medians of "
             f"{data['reps']} forwards (the two paths in alternation, best of three rounds). Host work from "
             f"greedy generations of {data['tokens']} tokens on 6 dev questions (one per category group).", "",
             "The parts are timed alone (bench/step_profile.py says how), so they need not add up exactly to the "
             "forward: glue is what is left.", ""]
    for dtype, res in data["results"].items():
        bw = statistics.median(res["bandwidth_gb_s"])
        floor = res["weight_bytes"] / bw / 1e6
        lines += [f"## {dtype}", "", f"Read bandwidth {bw:.1f} GB/s; the forward streams "
                  f"{res['weight_bytes'] / 1e6:.0f} MB: floor {floor:.2f} ms.", "",
                  "| step | path | forward ms | floor | matmuls above the floor | attention | glue | host | "
                  "step ms | floor / step |", "|---|---|---|---|---|---|---|---|---|---|"]
        for shape, p in res["shapes"].items():
            for path, fwd in p["forward"].items():
                host = res["host"][path]
                h = host["plain_step"] - fwd if shape == "plain step" else host["spec_other"]
                glue = fwd - p["matmuls"] - p["attention"]
                step = fwd + h
                lines.append(f"| {shape} | {path} | {fwd:.2f} | {floor:.2f} | {p['matmuls'] - floor:.2f} | "
                             f"{p['attention']:.2f} | {glue:.2f} | {h:.2f} | {step:.2f} | {floor / step:.0%} |")
        lines.append("")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_profile.md").write_text(text)
    (out / "step_profile.json").write_text(json.dumps({"machine": info, **data}, indent=1) + "\n")
    return text


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.step_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per generation for the host-work part")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info()
    data = measure(args)
    print(write(args.out, data, info))
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
