"""What the custom ops buy in a whole Token Recycling step: the step's time outside the weight matmuls (retrieve, the
verify forward's attention and glue, accept, compact, recycle) and end-to-end TR tokens/s, with the compiled kernels,
with their pure-PyTorch references, and with stock PyTorch (SDPA with a boolean mask, `topk` + indexed assignment),
on the same questions, one engine each, run in alternation. Writes bench/results/verify_step_cpu.{json,md}.

    python -m bench.verify_step [--questions 8] [--max-new-tokens 128] [--threads 2] [--dtypes float32 bfloat16]
"""

import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from bench.machine import machine_info, machine_line, save_results
from bench.specbench import DEFAULT_QUESTIONS, group_of, load_questions
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.engine import Engine
from tr_engine.model.ops import load_ops

IMPLS = ("kernels", "reference", "stock")
PHASES = ("retrieve", "verify", "accept", "compact", "recycle")


def stock_tree_attention(q, k, v, prefix_len, tree_mask, scale):
    """What the model does without the op: fold the query heads of each KV head into rows, one boolean mask."""
    T, Hq, D = q.shape
    Hkv, G = k.shape[0], q.shape[1] // k.shape[0]
    end = prefix_len + T
    folded = torch.cat([tree_mask.new_ones(T, prefix_len), tree_mask], dim=1).repeat(G, 1)  # [G*T, P+T]
    qf = q.reshape(T, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hkv, G * T, D)
    o = F.scaled_dot_product_attention(qf, k[None, :, :end], v[None, :, :end], attn_mask=folded, scale=scale)
    return o.view(Hkv, G, T, D).permute(2, 0, 1, 3).reshape(T, Hq, D)


def stock_recycle_update_(table, tokens, logits):
    """topk + indexed assignment. Ties and duplicate tokens are resolved however topk and index_put_ happen to."""
    table[tokens] = logits.topk(table.shape[1], dim=-1).indices


def op_set(impl: str) -> SimpleNamespace:
    if impl == "stock":
        # The references' namespace with the stock PyTorch calls swapped in (plain F.linear, nothing packed)
        stock = {"kind": "stock", "tree_attention": stock_tree_attention, "recycle_update_": stock_recycle_update_}
        return SimpleNamespace(**{**vars(load_ops("reference")), **stock})
    return load_ops(impl)


class MatmulClock:
    """Wraps a model so that the seconds spent in its weight matmuls during verify forwards are counted."""

    def __init__(self, model):
        self.seconds, self.active = 0.0, False
        ops, forward = model.ops, model.forward
        # The module path, whose projections are calls of ops.linear that can be clocked one by one (a fused layer,
        # one op, hides them: bench/step_profile.py measures that path part by part instead).
        model.fused_layers = False

        def linear(x, w):
            if not self.active:
                return ops.linear(x, w)
            t0 = time.perf_counter()
            y = ops.linear(x, w)
            self.seconds += time.perf_counter() - t0
            return y

        def timed_forward(*args, tree_mask=None, **kwargs):
            self.active = tree_mask is not None
            try:
                return forward(*args, tree_mask=tree_mask, **kwargs)
            finally:
                self.active = False

        model.ops = SimpleNamespace(**{**vars(ops), "linear": linear})
        model.forward = timed_forward


def make_engine(impl: str, dtype: torch.dtype, threads: int) -> tuple[Engine, MatmulClock]:
    # The kernels' engine keeps its projections packed for packed_linear; the others load plain weights for F.linear.
    # The paper's static tree, not the adaptive default: this bench measures one fixed step shape.
    engine = Engine.from_pretrained("smollm2-135m-instruct", dtype=dtype, threads=threads, tree="2.2.2",
                                    ops=op_set(impl))
    return engine, MatmulClock(engine.model)


def measure(args) -> dict:
    questions = load_questions(args.questions_file, None, None)
    step = max(len(questions) // args.questions, 1)
    chosen = questions[::step][: args.questions]
    results = {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        engines = {impl: make_engine(impl, dtype, args.threads) for impl in IMPLS}
        totals = {impl: dict(steps=0, tokens=0, decode_s=0.0, phase_s=0.0, matmul_s=0.0, identical=0, phases={})
                  for impl in IMPLS}
        for engine, _ in engines.values():  # warm up caches and the matrix (hot start), untimed
            engine.generate(questions[1]["turns"][0], max_new_tokens=args.max_new_tokens, method="tr")
        for i, q in enumerate(chosen):
            tokens = {}
            for impl, (engine, clock) in engines.items():  # in alternation: a noisy spell hits all alike
                clock.seconds = 0.0
                r = engine.generate(q["turns"][0], max_new_tokens=args.max_new_tokens, method="tr")
                g = r.generation
                t = totals[impl]
                t["steps"] += g.steps
                t["tokens"] += len(g.token_ids)
                t["decode_s"] += g.decode_s
                t["phase_s"] += sum(g.phase_s.values())
                for name, sec in g.phase_s.items():
                    t["phases"][name] = t["phases"].get(name, 0.0) + sec
                t["matmul_s"] += clock.seconds
                tokens[impl] = g.token_ids
            for impl in IMPLS:
                totals[impl]["identical"] += tokens[impl] == tokens["reference"]
            print(f"{dtype_name} question {i + 1}/{len(chosen)} ({group_of(q['category'])}) done", flush=True)
        for impl, t in totals.items():
            t["outside_matmul_ms_per_step"] = 1e3 * (t["phase_s"] - t["matmul_s"]) / t["steps"]
            t["matmul_ms_per_step"] = 1e3 * t["matmul_s"] / t["steps"]
            t["tok_s"] = t["tokens"] / t["decode_s"]
            t["mat"] = t["tokens"] / t["steps"]
            t["phase_ms_per_step"] = {name: 1e3 * sec / t["steps"] for name, sec in t.pop("phases").items()}
        results[dtype_name] = totals
    return {"questions": len(chosen), "max_new_tokens": args.max_new_tokens, "results": results}


def write(out: Path, data: dict, info: dict, args) -> str:
    lines = ["# A Token Recycling step with the kernels, their references and stock PyTorch", "",
             f"Machine: {machine_line(info)}. SmolLM2-135M-Instruct, tree 2.2.2 (81 tokens), hot matrix, "
             f"{data['questions']} dev-split questions (first turn), {data['max_new_tokens']} new tokens each; "
             "the three engines run each question in alternation.", "",
             "| dtype | ops | ms/step outside weight matmuls | kernels faster by | ms/step in weight matmuls | "
             "MAT | TR tokens/s (decode) | same tokens as reference |", "|---|---|---|---|---|---|---|---|"]
    for dtype_name, totals in data["results"].items():
        ours = totals["kernels"]["outside_matmul_ms_per_step"]
        for impl in IMPLS:
            t = totals[impl]
            lines.append(f"| {dtype_name} | {impl} | {t['outside_matmul_ms_per_step']:.2f} | "
                         f"{t['outside_matmul_ms_per_step'] / ours:.2f}x | {t['matmul_ms_per_step']:.2f} | "
                         f"{t['mat']:.2f} | {t['tok_s']:.1f} | {t['identical']}/{data['questions']} |")
    lines += ["", "Milliseconds per step by phase (verify includes its weight matmuls):", "",
              "| dtype | ops | " + " | ".join(PHASES) + " |", "|---|---|" + "---|" * len(PHASES)]
    for dtype_name, totals in data["results"].items():
        for impl in IMPLS:
            ph = totals[impl]["phase_ms_per_step"]
            lines.append(f"| {dtype_name} | {impl} | " + " | ".join(f"{ph[p]:.3f}" for p in PHASES) + " |")
    lines += ["", "Outside the weight matmuls = retrieve + verify + accept + compact + recycle, minus the time inside "
              "the projections and LM head of the verify forward (timed around each call). The reference recycle "
              "sorts stably to specify ties exactly, so it is slow by design; stock's `topk` resolves ties and "
              "duplicate tokens as it happens to, so its drafts (and MAT) may differ slightly."]
    return save_results(out / "verify_step_cpu", "\n".join(lines) + "\n", data, info)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.verify_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=8, help="questions, spread over the file's categories")
    ap.add_argument("--questions-file", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    info = machine_info()
    data = measure(args)
    print(write(args.out, data, info, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
