"""Each custom op against its pure-PyTorch reference and the stock-PyTorch way of doing the same thing, side by side
in one run, at a model's shapes (SmolLM2 by default; Vicuna-7B; tiny for a rehearsal), on the CPU or a GPU. Medians
of repeated calls, timed in alternation; on a GPU every call is synchronised before the clock is read. Ratios are
what to read (machines are noisy). Writes kernels_<device>[_<shape>][_<tier>].{json,md}: the CPU tier named unless it is
avx512bf16, so that an AVX2 machine's run (or `--tier avx2` on an AVX-512 one) gives kernels_cpu_avx2 beside the
AVX-512 host's kernels_cpu.

    python -m bench.kernels [--device cpu|cuda] [--shape smollm2|vicuna-7b|tiny] [--tier avx2] [--threads 2] [--reps 30]
"""

import itertools
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.machine import copy_bandwidth, machine_info, machine_line, multiply_add_peak, read_bandwidth, \
    save_results, tier_suffix
from bench.shapes import SHAPES, projections
from tr_engine.cli.args import integer
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.core.tree import sample_tree_mask as tree_mask
from tr_engine.model import cpu, reference
from tr_engine.model.ops import load_ops

TREE_TOKENS = (1, 16, 32, 64, 81, 128)
MATMUL_ROWS = (1, 4, 8, 12, 16, 32, 81, 512)  # a decode step, draft trees, the 2.2.2 tree, a prefill
PREFIXES = (128, 512, 2048)
K = 8  # matrix candidates per token

def dtypes(device: str) -> tuple[torch.dtype, ...]:
    """What each device's models run in: float32 and bfloat16 on a CPU, float16 and bfloat16 on a GPU."""
    return (torch.float16, torch.bfloat16) if device.startswith("cuda") else (torch.float32, torch.bfloat16)


def attention_cases(ops, c, device):
    """Tree attention at the shape's heads. stock = what the model does without the op: fold the query heads that
    share a KV head into rows, `scaled_dot_product_attention` with the boolean [G*T, P+T] mask (built once per
    forward, so outside the timing), unfold."""
    HQ, HKV, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    G = HQ // HKV
    for dtype in dtypes(device):
        for P in PREFIXES:
            for T in TREE_TOKENS:
                kv = torch.randn(2, HKV, P + 160, D).to(device, dtype)  # one layer's cache, with room past the tree
                q = torch.randn(T, HQ + 2 * HKV, D).to(device, dtype)[:, :HQ]  # a strided slice of the fused qkv
                mask = tree_mask(T).to(device)
                folded = torch.cat([torch.ones(T, P, dtype=torch.bool, device=device), mask], dim=1).repeat(G, 1)

                def stock(q=q, kv=kv, folded=folded, T=T, P=P):
                    qf = q.reshape(T, HKV, G, D).permute(1, 2, 0, 3).reshape(1, HKV, G * T, D)
                    o = F.scaled_dot_product_attention(qf, kv[None, 0, :, : P + T], kv[None, 1, :, : P + T],
                                                       attn_mask=folded)
                    return o.view(HKV, G, T, D).permute(2, 0, 1, 3).reshape(T, HQ * D)

                name = str(dtype).removeprefix("torch.")
                moved = dtype.itemsize * (2 * T * HQ * D + 2 * HKV * (P + T) * D)  # q, out; K and V it reads
                yield "tree_attention", f"T={T}, prefix {P}, {HQ}q/{HKV}kv heads, D={D} {name}", {"bytes": moved,
                    "ours": lambda q=q, kv=kv, mask=mask, P=P: ops.tree_attention(q, kv[0], kv[1], P, mask, D**-0.5),
                    "stock": stock,
                    "reference": lambda q=q, kv=kv, mask=mask, P=P: reference.tree_attention(q, kv[0], kv[1], P, mask,
                                                                                            D**-0.5)}


def model_matmul_cases(ops, c, device):
    """All of one forward's projections at T rows, each weight its own tensor (so they stream from memory, as in the
    model): on a CPU packed_linear on packed weights, against F.linear (oneDNN/MKL) and, to 16 rows, skinny_linear;
    on a GPU skinny_linear against F.linear (cuBLAS), which the GPU engine uses."""
    g = torch.Generator(device=device).manual_seed(0)  # made where used: a 7B model's weights never cross the bus
    cpu = device == "cpu"
    for dtype in dtypes(device):
        weights = [torch.randn(n, k, generator=g, device=device, dtype=dtype) * 0.05 for n, k in projections(c)]
        packed = [ops.pack(w) for w in weights] if cpu else None
        name = str(dtype).removeprefix("torch.")
        for T in MATMUL_ROWS:
            xs = {k: torch.randn(T, k, generator=g, device=device, dtype=dtype) for _, k in set(projections(c))}
            shape = f"T={T}, {len(weights)} projections ({sum(w.numel() for w in weights) / 1e6:.0f}M weights) {name}"
            moved = dtype.itemsize * sum(n * k + T * (n + k) for n, k in projections(c))  # weights, x, y
            flops = 2 * T * sum(n * k for n, k in projections(c))
            bf16 = dtype == torch.bfloat16  # (set against the tier's bf16 peak: its pair dot product's, if it has one)
            stock = lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights]  # noqa: E731
            if cpu:
                yield "packed_linear", shape, {
                    "bytes": moved, "flops": flops, "bf16": bf16,
                    "ours": lambda xs=xs: [ops.packed_linear(xs[w.shape[1]], p.data, p.n)
                                           for w, p in zip(weights, packed)],
                    "stock": stock,
                    "reference": lambda xs=xs: [reference.packed_linear(xs[w.shape[1]], p.data, p.n)
                                                for w, p in zip(weights, packed)]}
            if T <= 16:
                yield "skinny_linear", shape, {
                    "bytes": moved, "flops": flops, "bf16": bf16,
                    "ours": lambda xs=xs: [ops.skinny_linear(xs[w.shape[1]], w) for w in weights], "stock": stock,
                    "reference": lambda xs=xs: [reference.skinny_linear(xs[w.shape[1]], w) for w in weights]}
        del weights, packed


def median_ms(impls: dict, reps: int, device: str = "cpu") -> dict:
    """Median milliseconds per call of each implementation, timed in alternation (one call of each per round), so a
    slow spell of a noisy machine hits all of them alike. On a GPU the device is synchronised before each clock
    read, so a call's time is its kernels' (and its launches')."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for fn in impls.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in impls}
    for _ in range(reps):
        for name, fn in impls.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def cases(ops, c, device: str = "cpu"):
    """(op, shape, {implementation: callable, "bytes": the fewest bytes a call must move}) rows at the shapes of
    config `c`; 'stock' is what one writes without the op."""
    V, L, HKV, D = c.vocab_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    yield from attention_cases(ops, c, device)
    for T in (16, 81, 128):
        logits = torch.randn(T, V, device=device)
        tokens = torch.randint(0, V, (T,), device=device)
        table = torch.zeros(V, K, dtype=torch.long, device=device)

        def stock(table=table, tokens=tokens, logits=logits):
            table[tokens] = logits.topk(K, dim=-1).indices  # duplicates: undefined winner

        yield "recycle_update_", f"T={T}, V={V}, k={K}", {
            "bytes": 4 * T * V + 8 * T * K,  # the logits read, the rows written
            "ours": lambda: ops.recycle_update_(table, tokens, logits), "stock": stock,
            "reference": lambda: reference.recycle_update_(table, tokens, logits)}
    kv_dtype = dtypes(device)[0]
    for P in (512, 2048):
        cache = torch.randn(L, 2, HKV, P + 96, D).to(device, kv_dtype)
        src = torch.tensor([P + i for i in (1, 9, 30, 55, 70, 78)], device=device)

        def stock(cache=cache, src=src, P=P):
            cache[:, :, :, P + 1 : P + 1 + len(src)] = cache.index_select(3, src)

        what = f"6 accepted of 81, prefix {P}, [{L}, 2, {HKV}, S, {D}] {str(kv_dtype).removeprefix('torch.')}"
        yield "compact_kv_", what, {
            "bytes": 2 * L * 2 * HKV * len(src) * D * kv_dtype.itemsize,  # every accepted slot read and written
            "ours": lambda cache=cache, src=src, P=P: ops.compact_kv_(cache, src, P + 1), "stock": stock,
            "reference": lambda cache=cache, src=src, P=P: reference.compact_kv_(cache, src, P + 1)}
    for dtype in dtypes(device):
        # 1 row: a decode step; 4 and 16: small draft trees (the adaptive tree's sizes on a CPU)
        for T, (n_out, n_in) in itertools.product((1, 4, 16), sorted(set(projections(c)))):
            x = torch.randn(T, n_in, device=device, dtype=dtype)
            w = torch.randn(n_out, n_in, device=device, dtype=dtype)
            name = str(dtype).removeprefix("torch.")
            yield "skinny_linear", f"{T}x{n_in} @ {n_in}x{n_out} {name}", {
                "bytes": dtype.itemsize * (n_out * n_in + T * (n_in + n_out)),
                "ours": lambda x=x, w=w: ops.skinny_linear(x, w), "stock": lambda x=x, w=w: F.linear(x, w),
                "reference": lambda x=x, w=w: reference.skinny_linear(x, w)}
    yield from model_matmul_cases(ops, c, device)


def measure(device: str, shape: str, reps: int, only=None, log=print, config=None) -> list[dict]:
    """One row per case at the shapes of SHAPES[shape] (or `config`, a model's): each implementation's median ms,
    ours against stock and reference, and the bandwidth ours achieves against the device's measured copy bandwidth
    (the ceiling of these memory-bound ops)."""
    ops = load_ops("kernels")
    peak = copy_bandwidth(device)
    # The tier's arithmetic peaks: float32's and float16's multiply-add, and bf16's (the pair dot product's, twice the
    # work an instruction, where the tier has it: the avx512bf16 and amx tiers' vectors).
    arithmetic = {False: multiply_add_peak(), True: multiply_add_peak(bf16=True)} if device == "cpu" else None
    rows = []
    with torch.inference_mode():
        for op, what, impls in cases(ops, config or SHAPES[shape], device):
            if only and op not in only:
                continue
            moved, flops, bf16 = impls.pop("bytes"), impls.pop("flops", None), impls.pop("bf16", False)
            fma = arithmetic[bf16] if arithmetic is not None else None
            reference_fn = impls.pop("reference")  # slow by design: fewer calls, timed on its own
            # The memory floor from the read bandwidth of the moment, the better of a measurement just before the
            # row's calls and one just after (one at the start of a run put rows timed in a fast spell at 131%).
            roofline = flops is not None and fma is not None
            read = read_bandwidth(reps=3) if roofline else None
            ms = {**median_ms(impls, reps, device), **median_ms({"reference": reference_fn}, max(reps // 5, 3), device)}
            gb_s = moved / (ms["ours"] / 1e3) / 1e9
            rows.append({"op": op, "shape": what, **{f"{k}_ms": v for k, v in ms.items()},
                         "vs_stock": ms["stock"] / ms["ours"], "vs_reference": ms["reference"] / ms["ours"],
                         "bytes": moved, "gb_s": gb_s, "peak_gb_s": peak, "of_peak": gb_s / peak})
            if roofline:  # the larger of the memory and compute floors
                read = max(read, read_bandwidth(reps=3))
                floors = {"memory": 1e3 * moved / (read * 1e9), "compute": 1e3 * flops / (fma * 1e9)}
                bound = max(floors, key=floors.get)
                rows[-1].update(flops=flops, gflops=flops / ms["ours"] / 1e6, fma_gflops=fma, bf16_peak=bf16,
                                read_gb_s=read, of_fma=flops / ms["ours"] / 1e6 / fma, floor_ms=floors[bound],
                                bound=bound, of_floor=floors[bound] / ms["ours"])
            log(f"{op:16} {what:45} ours {ms['ours']:8.3f} ms  stock {ms['stock']:8.3f} ms  "
                f"({rows[-1]['vs_stock']:.2f}x)  {gb_s:7.1f} GB/s ({gb_s / peak:.0%} of {peak:.0f})"
                + (f"  {rows[-1]['gflops']:6.1f} GFLOPS ({rows[-1]['of_fma']:.0%} of {fma:.0f}), "
                   f"{rows[-1]['of_floor']:.0%} of its {rows[-1]['bound']} floor" if "gflops" in rows[-1] else ""))
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| op | shape | ours ms | stock PyTorch ms | ours vs stock | reference ms | ours GB/s | of copy peak | "
             "ours GFLOPS | of peak | floor ms | of floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        roof = (f"{r['gflops']:.1f} | {r['of_fma']:.0%} | {r['floor_ms']:.3f} ({r['bound']}) | {r['of_floor']:.0%}"
                if "gflops" in r else " |  |  | ")
        lines.append(f"| {r['op']} | {r['shape']} | {r['ours_ms']:.3f} | {r['stock_ms']:.3f} | {r['vs_stock']:.2f}x | "
                     f"{r['reference_ms']:.3f} | {r['gb_s']:.1f} | {r['of_peak']:.0%} | {roof} |")
    return lines


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--model", default=None, metavar="NAME|DIR",
                    help="take the shapes from this model's config.json instead of --shape")
    ap.add_argument("--threads", type=integer(1), default=2)
    ap.add_argument("--reps", type=integer(1), default=30)
    ap.add_argument("--only", nargs="+", metavar="OP", help="benchmark only these ops (e.g. tree_attention)")
    ap.add_argument("--tier", choices=cpu.NAMES, default=None,
                    help="the CPU kernel tier to measure (default: TR_ENGINE_CPU's, else the best this CPU runs)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    tier = cpu.use(args.tier) if args.device == "cpu" else None
    if args.device == "cuda" and not torch.cuda.is_available():
        from tr_engine.errors import UserError

        raise UserError("--device cuda: this torch build sees no CUDA device; run on a GPU machine or pass "
                        "--device cpu")
    torch.set_num_threads(args.threads)
    info = machine_info(args.device)
    config = None
    if args.model is not None:
        from tr_engine.model.config import LlamaConfig
        from tr_engine.model.folders import resolve_model

        folder = resolve_model(args.model)
        config, args.shape = LlamaConfig.from_json(folder / "config.json"), folder.name
    rows = measure(args.device, args.shape, args.reps, args.only, log=lambda line: print(line, flush=True),
                   config=config)
    kind = "CPU" if args.device == "cpu" else "CUDA"
    arithmetic = {r["bf16_peak"]: r["fma_gflops"] for r in rows if "gflops" in r}  # (float's and bf16's peaks)
    reads = [r["read_gb_s"] for r in rows if "gflops" in r]
    which = {False: "float32 and float16 (the float multiply-add)",
             True: "bfloat16 (the pair dot product where the tier has it)"}
    lines = [f"# {kind} kernels against stock PyTorch and their references ({args.shape} shapes)", "",
             f"Machine: {machine_line(info)}. Median of {args.reps} calls (references: fewer)"
             + (", each synchronised." if args.device == "cuda" else ".")
             + (f" GB/s: the fewest bytes a call must move over its time, against the {rows[0]['peak_gb_s']:.0f} "
                "GB/s copy bandwidth measured in the same run." if rows else "")
             + (" GFLOPS (the matmuls): 2 x rows x weights over the time, against the tier's arithmetic peak on "
                "these threads (bench.machine.multiply_add_peak: independent chains of the kernels' own vector "
                "instructions, no memory): "
                + "; ".join(f"{peak:.0f} GFLOPS for {which[bf16]}" for bf16, peak in sorted(arithmetic.items()))
                + ". Floor: the larger of the memory floor "
                f"(bytes / the read bandwidth, {min(reads):.0f}-{max(reads):.0f} GB/s in this run: "
                "bench.machine.read_bandwidth, the better of a measurement just before a row's calls and one just "
                "after, as this host's memory is faster in some minutes than in others) and "
                "the compute floor (FLOPs / that peak), the roofline; of floor = floor / ours."
                + (" On the amx tier the bf16 matmuls run on AMX's tiles, not the vector units, so they pass the "
                   "vectors' bf16 peak and its floor: read their float32 and float16 rows against theirs."
                   if tier == "amx" else "")
                if arithmetic else ""), "", *table(rows)]
    lines += ["", "stock: tree attention = `scaled_dot_product_attention` with a boolean mask, the query heads of "
              "each KV head folded into rows (as the model does without the op); recycle = `topk` + indexed "
              "assignment (its duplicate winner is unspecified); compaction = `index_select` + copy; skinny_linear "
              "and packed_linear = `F.linear` (MKL/oneDNN on a CPU, cuBLAS on a GPU). The recycle reference sorts "
              "stably to specify ties exactly, so it is slow by design; packed_linear's reference unpacks the weight "
              "at every call.",
              "", "The single-shape skinny_linear rows re-read one weight that stays in cache between calls, except "
              "the LM head. The \"projections\" rows run all of one forward's weights, each its own tensor, so they "
              "stream from memory as in a decode step or a verify: the case that matters. On a CPU the engine uses "
              "packed_linear for every dtype and row count; on a GPU, F.linear."]
    stem = ("kernels_cpu" if args.device == "cpu" and args.shape == "smollm2" else f"kernels_{args.device}_{args.shape}"
            ) + tier_suffix(tier)
    save_results(args.out / stem, "\n".join(lines) + "\n", {"shape": args.shape, "rows": rows}, info)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
