"""A model loaded for the engine: a known name, a Hugging Face folder or a GGUF file (folders.py) read into the
hand-written Llama (weights.py) on a device, in a dtype, with its ops, as this rank's shard under tensor parallelism
(parallel.py), and its tokenizer. Every setting is checked before any weights are read, each in one line."""

from dataclasses import dataclass
from pathlib import Path

import torch

from tr_engine import checks
from tr_engine.errors import InvalidType, InvalidValue, UserError
from tr_engine.model import parallel
from tr_engine.model.device import check_cuda_graphs, check_device
from tr_engine.model.folders import resolve_model
from tr_engine.model.llama import Llama
from tr_engine.model.ops import resolve_ops
from tr_engine.model.tokenizer import Tokenizer, load_tokenizer
from tr_engine.model.weights import load_model, parse_dtype

DEFAULT_MAX_CONTEXT = 8192  # cache capacity when the model allows more; --max-context raises it


@dataclass
class Loaded:
    model: Llama
    tokenizer: Tokenizer
    folder: Path
    max_context: int  # the cache's capacity: --max-context, else the model's context length up to the default
    cuda_graphs: bool | None  # as asked, but off under tensor parallelism


def load(name_or_path, device="cpu", dtype="auto", max_context: int | None = None, model_dir: str | None = None,
         ops="kernels", threads: int | None = None, cuda_graphs: bool | None = None, tp: int = 1, progress=None,
         parse_special_tokens: bool = False) -> Loaded:
    """Engine.from_pretrained's loading (its arguments of the same names)."""
    if not isinstance(name_or_path, (str, Path)):
        raise InvalidType(f"name_or_path must be a model name or folder (a str or Path), got "
                          f"{type(name_or_path).__name__}")
    try:
        ops = resolve_ops(ops)  # a spec ("kernels,tree_attention=reference") or a namespace: built once, here
    except InvalidType:
        raise
    except UserError as e:
        raise InvalidValue(str(e))
    if threads is not None:
        torch.set_num_threads(checks.integer(threads, "--threads", 1, checks.usable_cpus()))
    if max_context is not None:
        checks.integer(max_context, "--max-context", 1)
    folder = resolve_model(str(name_or_path), model_dir)
    device = check_device(device)
    dtype = parse_dtype(dtype, device)
    checks.integer(tp, "--tp", 1)
    if tp > 1 and cuda_graphs:
        raise UserError("--cuda-graphs on does not work with --tp yet (a graph would hold the all-reduces); "
                        "leave it out")
    check_cuda_graphs(cuda_graphs, device, ops)  # before the weights load
    shard = parallel.init(tp, device)
    model = load_model(folder, dtype, device, ops, shard, progress)  # progress(bytes done, total): a bar's input
    limit = model.config.max_position_embeddings
    if max_context is not None and not 1 <= max_context <= limit:
        raise UserError(f"--max-context {max_context} is outside 1..{limit} (the model's context length)")
    tokenizer = load_tokenizer(folder, model.config.eos_token_ids)
    tokenizer.parse_special = checks.flag(parse_special_tokens, "parse_special_tokens")
    return Loaded(model, tokenizer, folder, max_context or min(limit, DEFAULT_MAX_CONTEXT),
                  False if tp > 1 else cuda_graphs)
