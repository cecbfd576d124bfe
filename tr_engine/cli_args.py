"""The flags the command-line tools share (model, device, decoding), and the engine they describe."""

import argparse
import sys

from tr_engine.methods import ADAPTIVE, METHODS
from tr_engine.models import DEFAULT_MODEL


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"model folder or known name (default {DEFAULT_MODEL})")
    ap.add_argument("--model-dir", default=None, help="folder that holds known models by name (searched first)")
    ap.add_argument("--method", default="tr", choices=METHODS,
                    help="tr: Token Recycling (default); pld: prompt lookup; hybrid: both in one tree; ar: plain "
                         "greedy. Same output tokens")
    ap.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    ap.add_argument("--max-context", type=int, default=None, help="KV-cache capacity in tokens")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all available)")
    ap.add_argument("--ops", default="kernels", choices=["kernels", "reference"], help="compiled ops or their references")
    ap.add_argument("--tree", default=ADAPTIVE,
                    help="draft tree: adaptive (default: chosen each step for this machine's verify cost, measured "
                         "once and cached), 2.2.2 (the paper's static tree), or a JSON file of rank paths")
    ap.add_argument("--recalibrate", action="store_true", help="measure the verify cost curve again (--tree adaptive)")
    ap.add_argument("--matrix-k", type=int, default=8, help="candidates kept per token in the recycling matrix")
    ap.add_argument("--seed-from-prompt", action="store_true", help="seed the matrix from each prompt's prefill")
    add_sampling_args(ap)


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default): greedy; above 0: sample, with every method giving the model's distribution")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens only (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="sample among the most likely tokens that hold this much probability only (1: all)")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the sampling: the same seed gives the same answers, whatever the method")


def sampling_from_args(args):
    from tr_engine.sampling import Sampling

    return Sampling(args.temperature, args.top_k, args.top_p)


def engine_from_args(args):
    from tr_engine.engine import Engine  # imports torch: after argument parsing, so --help is instant

    engine = Engine.from_pretrained(args.model, args.device, args.dtype, args.max_context, args.model_dir, args.ops,
                                    args.threads, args.tree, args.matrix_k, args.method, args.seed)
    if args.tree == ADAPTIVE:  # measured at the first adaptive step (or now, on --recalibrate), with a notice
        engine.on_calibrate = lambda: print("measuring this machine's verify cost for the adaptive tree (once; "
                                            "cached)...", file=sys.stderr, flush=True)
        if args.recalibrate:
            engine.cost_model(recalibrate=True)
    return engine
