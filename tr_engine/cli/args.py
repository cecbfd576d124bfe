"""The flags the command-line tools share (model, device, decoding), and the engine they describe."""

import argparse
import os
import sys
import time
from pathlib import Path

from tr_engine import checks
from tr_engine.core.methods import ADAPTIVE, DEFAULT_METHOD, MAX_MATRIX_K, methods
from tr_engine.core.speculative_config import DEFAULT_SUFFIX_MB
from tr_engine.errors import UserError
from tr_engine.model.folders import DEFAULT_MODEL

# weights.DTYPES' names, torch-free
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16", "float64", "fp32", "bf16", "fp16")


def integer(low: int | None = None, high: int | None = None, what: str = ""):
    """An argparse type: an integer in [low, high]; `what` explains the bound."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        return _checked(checks.integer, value, low, high, what)
    return parse


def real(low: float | None = None, high: float | None = None, low_open: bool = False):
    """An argparse type: a finite number in [low, high] (or above low with low_open)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
        return _checked(checks.real, value, low, high, "", low_open=low_open)
    return parse


def _checked(check, value, low, high, what, **kwargs):
    try:
        return check(value, "it", low, high, **kwargs)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("it ") + (f" ({what})" if what else ""))


def ops_spec(text: str) -> str:
    """An argparse type: an --ops spec, as tr_engine.model.ops.parse_ops reads it (imported here, not at the top: it
    imports torch, and --help should not wait for that)."""
    from tr_engine.model.ops import parse_ops

    try:
        parse_ops(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e))
    return text


def speculative_config(text: str):
    """An argparse type: --speculative-config's JSON, checked (tr_engine/core/speculative_config.py)."""
    from tr_engine.core.speculative_config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative-config "))
    return text


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"model folder or known name (default {DEFAULT_MODEL})")
    ap.add_argument("--model-dir", default=None, help="folder that holds known models by name (searched first)")
    ap.add_argument("--method", default=None, choices=methods(),
                    help="hybrid (default, the fastest measured here): Token Recycling's tree with prompt lookup's "
                         "chain; tr: Token Recycling alone (with --tree 2.2.2: the paper's setting); pld: prompt "
                         "lookup; ar: plain greedy. Same output tokens")
    ap.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                    help="vLLM's speculative settings: '{\"method\": \"suffix\", \"num_speculative_tokens\": 16, "
                         "\"disable_by_batch_size\": 8}' (method: ar, tr, pld or ngram, hybrid, suffix: hybrid with "
                         "the suffix index; the most draft tokens a step verifies; the batch size above which steps "
                         "decode plainly)")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, metavar="DTYPE",
                    help="auto (default: float16 on a CPU, exact and nearest fp32's answers; float32 on a GPU), "
                         "float32, bfloat16 (~10%% faster than float16 on AVX512-BF16 CPUs), float16")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    ap.add_argument("--max-context", type=integer(1), default=None, help="KV-cache capacity in tokens")
    ap.add_argument("--threads", type=integer(1, checks.usable_cpus(), "the CPUs this process may use"), default=None,
                    help="CPU threads, fixed (default: torch's count, fewer while other processes keep CPUs busy)")
    ap.add_argument("--ops", default="kernels", type=ops_spec, metavar="KIND[,OP=KIND...]",
                    help="kernels (compiled, default) or reference (pure PyTorch), then any single op swapped, e.g. "
                         "kernels,tree_attention=reference")
    ap.add_argument("--tree", default=ADAPTIVE,
                    help="draft tree: adaptive (default: chosen each step for this machine's verify cost, measured "
                         "once and cached), 2.2.2 (the paper's static tree), or a JSON file of rank paths")
    ap.add_argument("--recalibrate", action="store_true", help="measure the verify cost curve again (--tree adaptive)")
    ap.add_argument("--matrix-k", type=integer(1, MAX_MATRIX_K, "the CUDA recycle kernel's limit"), default=8,
                    help="candidates kept per token in the recycling matrix")
    ap.add_argument("--seed-from-prompt", action="store_true", help="seed the matrix from each prompt's prefill")
    ap.add_argument("--suffix-index", type=integer(0, 1 << 16), default=DEFAULT_SUFFIX_MB, metavar="MB",
                    help="hybrid also drafts from a suffix index of every request answered, up to MB megabytes, "
                         f"resident as it fills, saved beside the matrix (default {DEFAULT_SUFFIX_MB}; 0: none)")
    ap.add_argument("--parse-special-tokens", action="store_true",
                    help="read special-token strings written inside messages (<|im_start|>, ...) as the control tokens "
                         "they name; by default they are text, so a message cannot forge a turn of another role")
    ap.add_argument("--tp", type=integer(1), default=1, metavar="N",
                    help="tensor parallelism: the model split across N processes, launched with torchrun "
                         "--nproc-per-node N (README, 'Several GPUs'); default 1")
    ap.add_argument("--cuda-graphs", default=None, choices=["on", "off"],
                    help="replay each decode and verify step as a CUDA graph (default: on with --device cuda)")
    add_sampling_args(ap)


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--temperature", type=real(0.0), default=0.0,
                    help="0 (default): greedy; above 0: sample, with every method giving the model's distribution")
    ap.add_argument("--top-k", type=integer(0), default=0, help="sample among the K most likely tokens only (0: all)")
    ap.add_argument("--top-p", type=real(0.0, 1.0, low_open=True), default=1.0,
                    help="sample among the most likely tokens that hold this much probability only (1: all)")
    ap.add_argument("--seed", type=integer(0, checks.MAX_SEED), default=None,
                    help="seed of the sampling: the same seed gives the same answers, whatever the method")


def add_matrix_args(ap: argparse.ArgumentParser) -> None:
    """The recycling matrix kept across runs (chat, serve): loaded at start, saved at the end."""
    ap.add_argument("--matrix", default=None, help="recycling matrix file (default: one per model in the cache)")
    ap.add_argument("--no-persist", action="store_true", help="neither load nor save the recycling matrix")


def load_matrix(args, engine):
    """Load the run's matrix file into the engine if it exists (a file that is not a matrix for this model stops
    the run, left as it is); the Path to save it to at the end, or None with --no-persist."""
    if args.no_persist:
        return None
    if args.matrix:
        path = Path(args.matrix)
    else:
        from tr_engine.model.folders import home

        path = home() / "matrices" / f"{engine.folder.name}-{engine.tokenizer.fingerprint()[:12]}-k{args.matrix_k}.pt"
    if path.is_file():
        engine.load_matrix(path)
    return path


def sampling_from_args(args):
    from tr_engine.core.sampling import Sampling

    return Sampling(args.temperature, args.top_k, args.top_p)


class LoadProgress:
    """Loading's progress on one terminal line, for models big enough to take a while (a 7B model: half a minute on a
    CPU): `loading NAME: 41% of 13.5 GB`, then the time it took. Nothing for small models or when stderr is not a
    terminal (logs and pipes get no carriage returns)."""

    MIN_BYTES = 1 << 30

    def __init__(self, name: str):
        self.name, self.shown, self.start = name, -1, time.monotonic()

    @classmethod
    def on_terminal(cls, name: str) -> "LoadProgress | None":
        """A display when stderr is a terminal, on one rank only under torchrun (every rank loads)."""
        return cls(name) if sys.stderr.isatty() and os.environ.get("RANK", "0") == "0" else None

    def __call__(self, done: int, total: int) -> None:
        percent = 100 * done // max(total, 1)
        if total >= self.MIN_BYTES and percent != self.shown:
            self.shown = percent
            print(f"\rloading {self.name}: {percent}% of {total / 1e9:.1f} GB", end="", file=sys.stderr, flush=True)

    def end(self, ok: bool) -> None:
        """Close the line: with the time it took (the weights read and prepared), or bare before an error."""
        if self.shown >= 0:
            print(f" in {time.monotonic() - self.start:.0f} s" if ok else "", file=sys.stderr, flush=True)


class CalibrationNotice:
    """What a command says while the adaptive tree measures this machine's verify cost (Engine.on_calibrate): on a
    terminal one line, its percentage climbing, closed with the seconds it took; elsewhere (a log) the line at the
    start. Either way a curve that was not saved (the machine was busy) says why, on a line of its own."""

    TEXT = "measuring this machine's verify cost for the adaptive tree (once; cached)..."

    def __init__(self):
        self.terminal = sys.stderr.isatty()
        self.start = 0.0
        self.shown = -1

    def __call__(self, fraction: float, doubt: str | None) -> None:
        percent = int(100 * fraction)
        if fraction == 0.0:
            self.start = time.monotonic()
            print(self.TEXT, end="" if self.terminal else "\n", file=sys.stderr, flush=True)
        elif fraction < 1.0 and self.terminal and percent != self.shown:
            print(f"\r{self.TEXT} {percent}%", end="", file=sys.stderr, flush=True)
        elif fraction >= 1.0:
            if self.terminal:
                print(f"\r{self.TEXT} done in {time.monotonic() - self.start:.0f} s", file=sys.stderr, flush=True)
            if doubt is not None:
                print(f"note: the verify cost was not cached ({doubt}); this run prices its trees by a default curve "
                      "and the next run measures again",
                      file=sys.stderr, flush=True)
        self.shown = percent


def engine_from_args(args):
    from tr_engine.engine import Engine  # imports torch: after argument parsing, so --help is instant

    from tr_engine.core.speculative_config import SpeculativeConfig

    chosen = SpeculativeConfig.parse(args.speculative_config or {}).method
    if args.method is not None and chosen is not None and chosen != args.method:
        raise UserError(f"--method {args.method} and --speculative-config's method ({chosen}) disagree; give one")
    progress = LoadProgress.on_terminal(args.model)
    try:
        engine = Engine.from_pretrained(args.model, args.device, args.dtype, args.max_context, args.model_dir,
                                        args.ops, args.threads, args.tree, args.matrix_k,
                                        args.method or DEFAULT_METHOD, args.seed,
                                        None if args.cuda_graphs is None else args.cuda_graphs == "on",
                                        max_batch=getattr(args, "batch", 8), tp=args.tp, progress=progress,
                                        suffix_bytes=args.suffix_index << 20,
                                        speculative_config=args.speculative_config,
                                        parse_special_tokens=args.parse_special_tokens)
    except BaseException:
        if progress is not None:
            progress.end(ok=False)
        raise
    if progress is not None:
        progress.end(ok=True)
    args.method = engine.method  # (--speculative-config's, or --method's)
    if args.tree == ADAPTIVE:  # measured at the first adaptive step (or now, on --recalibrate), with a notice
        if engine.model.shard.rank == 0:  # (every rank measures under --tp; one says so)
            engine.on_calibrate = CalibrationNotice()
        if args.recalibrate:
            engine.cost_model(recalibrate=True)
    return engine
