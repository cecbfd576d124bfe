"""Where a plain decode step and an 8-token verify go, against the floor, with the decoder layers as one op each (the
fused path, Llama.fused_layers) and as the module path's PyTorch ops (before the fused op), measured in alternation on
one engine. Writes bench/results/step_profile.{md,json}.

    python -m bench.step_profile [--dtypes bfloat16 float32] [--prefix 256] [--reps 30] [--rounds 5] [--threads 2]

The parts of a forward at T rows (1 for a plain step; 8, a chain as a tree mask, for a verify):
  - floor: the bytes of weights the forward streams / this machine's best read bandwidth in the run
    (bench.machine.read_bandwidth);
  - weight matmuls above the floor: the forward's 4 projections per layer and the LM head, run alone in the same
    order at the same T (packed_linear), minus the floor: arithmetic, and streaming slower than the bandwidth;
  - attention: tree_attention alone over every layer's cache at the prefix;
  - glue: the forward minus those: RMSNorm, RoPE, the cache write, SiLU * up, residual adds, op dispatch, Python;
  - host: a plain step's decode time minus its forwards' (timed around each), per step: argmax, the loop; for a
    verify, the hybrid method's retrieve + accept + compact + recycle per step, from a generation's phase clock.
"""

import statistics
import time
from pathlib import Path

import torch

from bench.machine import machine_info, machine_line, read_bandwidth, save_results
from bench.peers import weight_bytes
from bench.specbench import DEFAULT_QUESTIONS, load_questions
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.engine import Engine
from tr_engine.model.folders import DEFAULT_MODEL

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


def parts(engine: Engine, prefix: int, T: int, reps: int, rounds: int, bandwidth: list[float]) -> dict:
    """Milliseconds of the forward (each path), its matmuls and its attention at T rows after `prefix` tokens: each
    part's median in every round, the parts in alternation within a round, and the best round of each part (a slow
    spell of this shared machine then costs a round, not the result). A read-bandwidth sample joins `bandwidth` each
    round."""
    model, cache = engine.model, engine.cache
    ops, data = model.ops, cache.data
    cfg = model.local_config
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (prefix,)), torch.arange(prefix), data, 0)
        tokens, positions = torch.randint(0, model.config.vocab_size, (T,)), prefix + torch.arange(T)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        x = torch.randn(T, cfg.hidden_size).to(model.dtype)
        o_in = torch.randn(T, cfg.num_attention_heads * cfg.head_dim).to(model.dtype)
        down_in = torch.randn(T, cfg.intermediate_size).to(model.dtype)
        q = torch.randn(T, cfg.num_attention_heads, cfg.head_dim).to(model.dtype)

        def forward(fused: bool):
            def run():
                model.fused_layers = fused
                model(tokens, positions, data, prefix, tree_mask=mask)
            return run

        def matmuls():  # the forward's projections and LM head, in its order, alone
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                ops.linear(x, a.qkv_weight), ops.linear(o_in, a.o_weight)
                ops.linear(x, m.gate_up_weight), ops.linear(down_in, m.down_weight)
            ops.linear(x, model.head_weight)

        def attention():
            for kv in data:
                ops.tree_attention(q, kv[0], kv[1], prefix, mask, cfg.head_dim**-0.5)

        timed = {**{f"forward {name}": forward(fused) for name, fused in PATHS.items()}, "matmuls": matmuls,
                 "attention": attention}
        best = {}
        for _ in range(rounds):
            bandwidth.append(read_bandwidth())
            for name, fn in timed.items():
                ms = median_ms(fn, reps)
                best[name] = min(best.get(name, ms), ms)
        model.fused_layers = True
    return dict(forward={name: best[f"forward {name}"] for name in PATHS}, matmuls=best["matmuls"],
                attention=best["attention"])


def host_ms(engine: Engine, questions: list[dict], tokens: int) -> dict:
    """Work outside the forward, per step, from generations: a plain step's decode time minus its forwards' (timed
    around each one-token forward), and hybrid's retrieve + accept + compact + recycle (its phase clock)."""
    model = engine.model
    forward, spent = model.forward, [0.0]

    def timed_forward(input_ids, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return forward(input_ids, *args, **kwargs)
        finally:
            if input_ids.shape[0] == 1:  # a decode step (the prompt's forward is not in decode_s)
                spent[0] += time.perf_counter() - t0

    model.forward = timed_forward
    try:
        plain_s, plain_steps, other_s, spec_steps = 0.0, 0, 0.0, 0
        for q in questions:
            spent[0] = 0.0
            g = engine.generate(q["turns"][0], max_new_tokens=tokens, method="ar", reuse_cache=False).generation
            plain_s, plain_steps = plain_s + g.decode_s - spent[0], plain_steps + g.steps
            g = engine.generate(q["turns"][0], max_new_tokens=tokens, method="hybrid", reuse_cache=False).generation
            other_s += sum(s for name, s in g.phase_s.items() if name != "verify")
            spec_steps += g.steps
    finally:
        del model.forward  # the class's method again
    return {"plain step": 1e3 * plain_s / plain_steps, "8-token verify": 1e3 * other_s / spec_steps}


def measure(args) -> dict:
    questions = load_questions(DEFAULT_QUESTIONS, None, None, per_group=1)
    results = {}
    for dtype in args.dtypes:
        engine = Engine.from_pretrained(args.model, dtype=dtype, threads=args.threads)
        bw: list[float] = []
        shapes = {name: parts(engine, args.prefix, T, args.reps, args.rounds, bw) for name, T in SHAPES.items()}
        host = {}
        for name, fused in PATHS.items():
            engine.model.fused_layers = fused
            host[name] = host_ms(engine, questions, args.tokens)
        engine.model.fused_layers = True
        results[dtype] = dict(bandwidth_gb_s=bw, weight_bytes=weight_bytes(engine), shapes=shapes, host=host)
    return {"model": Path(args.model).name, "prefix": args.prefix, "reps": args.reps, "rounds": args.rounds,
            "tokens": args.tokens, "results": results}


def write(out: Path, data: dict, info: dict) -> str:
    lines = ["# A plain step and an 8-token verify, part by part", "",
             f"Machine: {machine_line(info)}. {data['model']}, prefix {data['prefix']} tokens. Each part is the "
             f"median of {data['reps']} runs, the parts in alternation, the best of {data['rounds']} rounds; the "
             "floor is the weight bytes over the best read bandwidth measured between the rounds, so the machine at "
             f"its best on both sides. Host work from greedy generations of {data['tokens']} tokens on 6 dev "
             "questions (one per category group).", "",
             "The parts are timed alone (bench/step_profile.py says how), so they need not add up exactly to the "
             "forward: glue is what is left.", ""]
    for dtype, res in data["results"].items():
        bw = max(res["bandwidth_gb_s"])
        floor = res["weight_bytes"] / bw / 1e6
        lines += [f"## {dtype}", "", f"Read bandwidth {bw:.1f} GB/s (the best of {len(res['bandwidth_gb_s'])} "
                  f"measurements; the median {statistics.median(res['bandwidth_gb_s']):.1f}); the forward streams "
                  f"{res['weight_bytes'] / 1e6:.0f} MB: floor {floor:.2f} ms.", "",
                  "| step | path | forward ms | floor | matmuls above the floor | attention | glue | host | "
                  "step ms | floor / step |", "|---|---|---|---|---|---|---|---|---|---|"]
        for shape, p in res["shapes"].items():
            for path, fwd in p["forward"].items():
                h = res["host"][path][shape]
                glue = fwd - p["matmuls"] - p["attention"]
                step = fwd + h
                lines.append(f"| {shape} | {path} | {fwd:.2f} | {floor:.2f} | {p['matmuls'] - floor:.2f} | "
                             f"{p['attention']:.2f} | {glue:.2f} | {h:.2f} | {step:.2f} | {floor / step:.0%} |")
        lines.append("")
    return save_results(out / "step_profile", "\n".join(lines) + "\n", data, info)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.step_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a known name or a Hugging Face folder")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
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
