"""Loads a Hugging Face model folder's safetensors into the hand-written Llama, strictly.

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) folders. The model is built on the
`meta` device and each tensor is read on its own (SafetensorsFile: plain reads, no memory map) and cast to the
requested dtype as it is read, then fused and packed layer by layer, so a model loads in about one model's worth of
memory at every point (tests/test_weights.py measures it). Every missing, unexpected or mis-shaped key is an error
that names it.
"""

import ctypes
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from tr_engine.errors import UserError, WeightsError
from tr_engine.model.config import LlamaConfig
from tr_engine.model.llama import Llama
from tr_engine.model.ops import packs
from tr_engine.model.parallel import ALONE, Shard, slices

# Keys some checkpoints carry that hold no learned weights (old Llama/Vicuna exports save RoPE's inv_freq buffer).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def default_dtype(device: torch.device | str) -> torch.dtype:
    """What dtype "auto" means: the fastest exact one on the device that keeps the model's answers. On a CPU float16:
    every CPU tier's kernels are row-independent, so speculative decoding in a half type is bit for bit plain
    decoding, and a half-precision step streams half of fp32's bytes (plain decoding 1.5-1.8x fp32's, README "CPUs").
    Of the two half types, float16 keeps 3 more mantissa bits: SmolLM2's logits land within 0.04 of fp32's where
    bf16's move by 0.5, enough to flip its answer to "What is the capital of France?" (avx512bf16 tier); over 48 dev
    questions on the amx tier float16's answers were fp32's on 34, bf16's on 8 (bench/results/dtypes_amx.md). float16
    decodes plainly as fast as bf16 on the AVX2 tier (F16C widens it in one instruction), its verify steps cost more
    there (hybrid in bf16 1.12x f16's: README "CPUs"), it is ~10% slower on AVX512-BF16 hosts (no fp16 dot product),
    and on the amx tier, whose bf16 matmuls run on AMX's tiles, hybrid in bf16 ran 1.48x f16's (48 dev questions,
    prefills included); `--dtype bfloat16` takes that back, and a model whose activations overflow float16 is told to
    (decode.prefill). On a GPU float32: its stock half-precision matmuls are not row-independent, so only fp32 keeps
    drafting exact."""
    return torch.float16 if torch.device(device).type == "cpu" else torch.float32


def parse_dtype(name: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """A dtype from its name (or a torch.dtype); "auto": default_dtype(device)."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise UserError(f"dtype {name} cannot run a model; choose one of float32, bfloat16, float16, float64")
        return name
    if name == "auto":
        return default_dtype(device)
    if not isinstance(name, str) or name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of auto, float32, bfloat16, float16, float64")
    return DTYPES[name]


# What a weight may be stored as (safetensors' names) and what it is read as. Integers and bools would be cast and
# used without a word, and an 8-bit float is meaningless without the scales that quantized checkpoints carry beside it.
STORED = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
WEIGHT_DTYPES = tuple(STORED)


class SafetensorsFile:
    """One safetensors file, read tensor by tensor with plain reads into fresh buffers. The format is an 8-byte
    little-endian header length, a JSON header ({name: {dtype, shape, data_offsets}}, data_offsets relative to the
    end of the header), then the data. Not memory-mapped, unlike safetensors' safe_open: a mapped file's pages count
    as the process's own once touched, until the mapping goes, so loading through one held the file beside the
    weights read from it (twice the weights at the peak). Every inconsistency is a WeightsError saying the file is
    corrupt or truncated."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.file = open(path, "rb")
        except OSError as e:
            raise WeightsError(f"{path} cannot be read ({e.strerror or e}); check the file and its permissions")
        try:
            size = os.fstat(self.file.fileno()).st_size
            raw = self.file.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < n <= size - 8:
                self.corrupt("no header")
            header = json.loads(self.file.read(n))
            self.data_start = 8 + n
            self.tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            for key, info in self.tensors.items():
                begin, end = info["data_offsets"]
                if not (0 <= begin <= end and self.data_start + end <= size and all(d >= 0 for d in info["shape"])):
                    self.corrupt(f"{key} lies outside the file")
        except (ValueError, KeyError, TypeError) as e:  # (json.JSONDecodeError and UnicodeDecodeError included)
            self.close()
            self.corrupt(f"bad header: {e}")
        except WeightsError:
            self.close()
            raise

    def corrupt(self, why: str):
        raise WeightsError(f"{self.path} is corrupt or truncated ({why}); download or convert it again")

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()

    def keys(self) -> list[str]:
        return list(self.tensors)

    def dtype(self, key: str) -> str:
        return self.tensors[key]["dtype"]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key]["shape"])

    def nbytes(self, key: str) -> int:
        """The bytes the file holds for `key` (as its header says)."""
        begin, end = self.tensors[key]["data_offsets"]
        return end - begin

    def read(self, key: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """Tensor `key` in its stored dtype, or only rows (dim 0) or columns (dim 1) start..stop of it: `part` =
        (dim, start, stop). Rows are read alone; columns are cut from the whole tensor, read one at a time."""
        info, dtype = self.tensors[key], STORED[self.dtype(key)]
        shape, (begin, end) = list(info["shape"]), info["data_offsets"]
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize != end - begin:
            self.corrupt(f"{key} holds {end - begin} bytes, its shape {shape} needs {numel * dtype.itemsize}")
        offset = self.data_start + begin
        if part is not None and part[0] == 0:
            row_bytes = (end - begin) // max(shape[0], 1)
            offset += part[1] * row_bytes
            shape[0] = part[2] - part[1]
        tensor = torch.empty(shape, dtype=dtype)
        if tensor.numel():
            buffer = tensor.view(-1).view(torch.uint8).numpy()
            try:
                self.file.seek(offset)
                got = self.file.readinto(memoryview(buffer))
            except OSError as e:
                raise WeightsError(f"{self.path} cannot be read ({e.strerror or e}); check the file and its "
                                   "permissions")
            if got != buffer.nbytes:
                self.corrupt(f"{key} ends early")
        if part is not None and part[0] == 1:
            tensor = tensor[:, part[1] : part[2]].clone()
        return tensor


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's safetensors shards, in index order; a clear error when there are none."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index ({e}); re-download or regenerate it")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{folder}: shards listed in the index are missing: {', '.join(missing)}; "
                               "download them again")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    if list(folder.glob("pytorch_model*.bin")):
        raise WeightsError(f"{folder} has PyTorch .bin weights only; convert them first: "
                           f"python -m weights_tools.bin_to_safetensors {folder}")
    raise WeightsError(f"{folder} has no model.safetensors or model.safetensors.index.json; "
                       "point --model at a Hugging Face model folder")


def finite(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` is finite: its minimum and maximum are (NaN propagates through both), one
    pass over it that allocates nothing of its size (a whole-tensor isfinite or float64 sum would, at load's peak)."""
    if weight.numel() == 0:
        return True
    low, high = torch.aminmax(weight)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def check_finite(weight: torch.Tensor, stored: torch.Tensor, what: str, dtype: torch.dtype) -> None:
    """Refuse a weight with a NaN or an infinity (a model that answers end-of-text tokens to everything otherwise),
    in one line: in the file, or made by the cast to `dtype` (a float32 value past float16's range)."""
    if finite(weight):
        return
    if not finite(stored):
        bad = int((~torch.isfinite(stored)).sum())  # (the error path: the count may allocate)
        raise WeightsError(f"{what} holds {bad} NaN or infinite value(s); the file is corrupt or the model diverged "
                           "in training: use another copy of the weights")
    raise WeightsError(f"{what} holds values beyond {str(dtype).removeprefix('torch.')}'s range (it is stored as "
                       f"{str(stored.dtype).removeprefix('torch.')}); load it with --dtype bfloat16 or float32")


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu", ops="kernels",
               shard: Shard = ALONE, progress: Callable[[int, int], None] | None = None) -> Llama:
    """Build the model from `folder` (config.json + safetensors) in `dtype` on `device`, ready for inference, its
    projections and decode/verify attention computed by `ops` (tr_engine.model.ops: a spec like "kernels", or a
    namespace). Under tensor parallelism (`shard`), this rank's slice only, each weight's rows or columns read from the
    file
    alone (tr_engine/model/parallel.py). `progress(done, total)`, if given, hears the bytes of the files gone through
    after each tensor (a 7B model takes half a minute on a CPU; a progress bar's input)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"model folder {folder} does not exist; pass a Hugging Face model folder or a known model name")
    config = LlamaConfig.from_json(folder / "config.json")
    with torch.device("meta"):
        model = Llama(config, ops, shard)
        whole = model if shard.world == 1 else Llama(config, ops)  # the shapes the files hold
    expected = {name: p.shape for name, p in whole.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    cut = slices(config, shard) if shard.world > 1 else {}

    state, unexpected = {}, []
    files = safetensors_files(folder)
    total, done = sum(p.stat().st_size for p in files), 0
    for path in files:
        with SafetensorsFile(path) as f:
            done += f.data_start
            for key in f.keys():
                done += f.nbytes(key)
                if key.endswith(IGNORED_SUFFIXES) or (key == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                if key not in expected:
                    unexpected.append(key)
                    continue
                stored = f.dtype(key)
                if stored not in WEIGHT_DTYPES:
                    raise WeightsError(f"{path.name}: weight {key} is stored as {stored}, not as floating point "
                                       f"({', '.join(WEIGHT_DTYPES)}); a quantized or corrupt checkpoint: "
                                       "convert it to float16, bfloat16 or float32 first")
                shape = f.shape(key)
                if shape != tuple(expected[key]):
                    raise WeightsError(f"{path.name}: weight {key} has shape {list(shape)}, the config implies "
                                       f"{list(expected[key])}; config.json and the weights do not match")
                # this rank's rows or columns alone under tensor parallelism; cast as read (a fresh buffer: the
                # file is not mapped, so nothing of it stays resident)
                part = next((cut[suffix] for suffix in cut if key.endswith(suffix)), None)
                stored = f.read(key, part)
                state[key] = stored.to(device=device, dtype=dtype)
                check_finite(state[key], stored, f"{path.name}: weight {key}", dtype)
                del stored  # (a cast's source: gone before the next tensor is read)
                if progress is not None:
                    progress(done, total)
    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        parts = []
        if missing:
            more = " …" if len(missing) > 3 else ""
            parts.append(f"missing {len(missing)} weight(s): {', '.join(missing[:3])}{more}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {', '.join(sorted(unexpected)[:3])}"
                         f"{' …' if len(unexpected) > 3 else ''}")
        raise WeightsError(f"{folder}: {'; '.join(parts)}; the weights do not belong to this Llama config")
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    # The model holds the tensors now; the dict must let go of them before fuse_ and pack_ replace each layer's
    # weights, or every replaced tensor would stay alive beside its replacement (twice the weights at the peak).
    del state
    return _ready(model, dtype, device)


def random_model(config: LlamaConfig, dtype: torch.dtype = torch.float32, device="cpu", ops="kernels",
                 seed: int = 0, std: float = 0.02) -> Llama:
    """A Llama of this config with random weights (normal, `std`; norms 1) made directly on `device`: what the GPU
    check measures a Vicuna-7B-shaped model with where no weights can travel. Ready like load_model's."""
    with torch.device("meta"):
        model = Llama(config, ops)
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # (after to_empty, which gives each module its own tensor)
        model.lm_head.weight = model.model.embed_tokens.weight
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is one parameter, filled once
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=g)
    return _ready(model, dtype, device)


def _ready(model: Llama, dtype: torch.dtype, device) -> Llama:
    """Inference mode, fused projections, and on a CPU the packed layout of the matmul kernel."""
    model.requires_grad_(False).eval()
    model.fuse_()
    if model.ops.pack is not None and packs(dtype, device):
        def pack(w: torch.Tensor) -> torch.Tensor:  # what the packing so far let go of goes back first
            release_freed_memory()
            return model.ops.pack(w)

        model.pack_(pack)
        release_freed_memory()
    return model


def release_freed_memory() -> None:
    """Hand the heap pages that loading freed back to the system. glibc keeps freed memory in the process: here the
    plain weights that the packed ones replace, which the packed weights used to reuse until they moved to huge pages
    of their own (csrc/cpu/packed_linear.cpp). Called before each weight is packed and once after: a SmolLM2 bf16
    load grows the process by 1.02x the weights it holds, after loading and at its peak (1.10x before, 1.28x with
    the huge pages and no trim: bench.load_memory --shape smollm2). Nothing where the C library has no malloc_trim
    (not glibc)."""
    if (trim := glibc("malloc_trim")) is not None:
        trim(0)


def server_malloc() -> None:
    """glibc's malloc set for a long-running server, so that what a request takes goes back to the system. Called by
    the server before it loads the model or starts a thread; nothing where the C library has no mallopt.
    - One arena: every thread started from now on allocates from glibc's main arena. malloc_trim hands back the free
      pages of every arena but the free top of the main one alone; another thread's arena keeps its top until it
      passes the trim threshold, which glibc raises to as much as 64 MB. The server tokenizes a request on a worker
      thread: after a 1 MB prompt refused for its length, 37-40 MB stayed at that thread's arena's top (+15% of a tiny
      model's server), none with one arena; no slower (AVX2 host: generate ar and hybrid, 3 alternating runs each;
      bench.serve hybrid at 4 and 16 clients, 2 each).
    - A fixed mmap threshold of 1 MB: glibc maps a large block of its own and unmaps it when freed, but raises that
      threshold to the largest block freed so far (up to 32 MB), so the steps' temporaries (logits, activations: 1-30
      MB, larger as longer prompts and verifies come) move into the heap, whose free middle stays resident. A
      2000-request soak (bench.serve --soak) grew by 8.5% in steps as new sizes came (6% by request 500); with the
      threshold fixed at 1 MB, 500 requests grew 0.6% (at 4 MB: 8.3%, the blocks of 1-4 MB did it) and 2000 requests
      1.3%, half of it the suffix index's own growth. Mapping the blocks
      anew costs nothing measured: generate_batch hybrid, SmolLM2 bf16, 1 MB against 32 MB alternated in one process,
      1.015x the tokens/s at batch 1, 0.996x at 8 (Zen 4)."""
    if (mallopt := glibc("mallopt")) is not None:
        mallopt(-8, 1)  # M_ARENA_MAX (malloc.h)
        mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed (so no longer raised by glibc)


def glibc(name: str):
    """The C library's function `name` (glibc's malloc_trim, mallopt), or None where it has none."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
