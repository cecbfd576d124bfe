"""Convert PyTorch `.bin` checkpoint shards (as Vicuna v1.3 ships them) into safetensors shards.

Loads with `torch.load(weights_only=True)`, so no pickled code ever runs. Keeps the shard grouping, writes
`model.safetensors.index.json`, drops RoPE `inv_freq` buffers (not weights), and copies the folder's config and
tokenizer files. Memory: one shard at a time.

    python -m weights_tools.bin_to_safetensors IN_DIR OUT_DIR
"""

import json
import pickle
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from tr_engine.cli.common import ArgumentParser, run
from tr_engine.errors import UserError, WeightsError
from weights_tools._progress import progress

DROPPED_SUFFIXES = (".rotary_emb.inv_freq",)
COPIED = ("config.json", "generation_config.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


class ConversionError(WeightsError):
    pass


def bin_shards(in_dir: Path) -> list[Path]:
    if not in_dir.is_dir():
        raise ConversionError(f"{in_dir} is not a folder; pass the folder that holds pytorch_model*.bin")
    index = in_dir / "pytorch_model.bin.index.json"
    if index.is_file():
        try:
            names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError, TypeError) as e:
            raise ConversionError(f"{index} is not a valid checkpoint index ({type(e).__name__}); download it again")
        missing = [n for n in names if not (in_dir / n).is_file()]
        if missing:
            raise ConversionError(f"{in_dir}: shards listed in the index are missing: {', '.join(missing[:3])}; "
                                  "download them again")
        return [in_dir / n for n in names]
    single = in_dir / "pytorch_model.bin"
    if single.is_file():
        return [single]
    raise ConversionError(f"{in_dir} has no pytorch_model.bin or pytorch_model.bin.index.json")


def convert(in_dir: Path, out_dir: Path) -> None:
    shards = bin_shards(in_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for i, shard in enumerate(progress(shards, len(shards), "converting shards"), 1):
        try:
            state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise ConversionError(f"{shard.name} cannot be loaded safely ({first}); it is truncated, corrupt or holds "
                                  "code rather than weights")
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ConversionError(f"{shard.name} is not a state dict of tensors; pass a Hugging Face checkpoint folder")
        for k, v in state.items():
            if not v.is_floating_point() and not k.endswith(DROPPED_SUFFIXES):
                raise ConversionError(f"{shard.name}: {k} is stored as {str(v.dtype).removeprefix('torch.')}, not "
                                      "floating point; a quantized checkpoint cannot be converted")
        # safetensors refuses tensors that share storage; clone so each is written on its own.
        tensors = {k: v.contiguous().clone() for k, v in state.items() if not k.endswith(DROPPED_SUFFIXES)}
        name = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del state, tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for name in COPIED:
        if (in_dir / name).is_file() and in_dir.resolve() != out_dir.resolve():
            shutil.copy2(in_dir / name, out_dir / name)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m weights_tools.bin_to_safetensors", description=__doc__.split("\n\n")[0])
    ap.add_argument("in_dir", type=Path, help="folder with pytorch_model*.bin and config.json")
    ap.add_argument("out_dir", type=Path, nargs="?", help="output folder (default: IN_DIR itself)")
    args = ap.parse_args(argv)
    try:
        convert(args.in_dir, args.out_dir or args.in_dir)
    except OSError as e:
        raise UserError(f"cannot convert {args.in_dir}: {e.strerror or e} ({e.filename}); check the folders and the "
                        "free disk space")
    print(f"wrote {args.out_dir or args.in_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
