"""Convert a llama.cpp GGUF file of a Llama-architecture model into a Hugging Face folder.

Writes config.json, model.safetensors (dequantized, float32), tokenizer.json, tokenizer_config.json (with the chat
template) and generation_config.json. Two llama.cpp conventions are undone: tensor names, and the row permutation
its converter applies to q_proj/k_proj for interleaved RoPE (shared/FACTS.md: the model still talks without undoing
it, only worse, so it is tested against transformers' own GGUF loader rather than by eye).

    python -m weights_tools.gguf_to_hf MODEL.gguf OUT_DIR
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from tr_engine.cli.common import ArgumentParser, run
from tr_engine.errors import UserError, WeightsError
from weights_tools._progress import progress

# GGUF tensor name (after "blk.{i}.") -> Hugging Face key (after "model.layers.{i}.").
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_CONTROL_TOKEN = 3


class ConversionError(WeightsError):
    pass


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    stem, suffix = gguf_name.rsplit(".", 1)
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    raise ConversionError(f"unknown GGUF tensor {gguf_name!r}: only Llama-architecture files are supported")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (pair, half) -> (half, pair). w: [out, in]."""
    out_features, in_features = w.shape
    head_dim = out_features // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, in_features).swapaxes(1, 2).reshape(out_features, in_features)


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def required(reader, key):
    value = field(reader, key)
    if value is None:
        raise ConversionError(f"the GGUF file has no {key!r} field; it is not a complete llama.cpp model file")
    return value


def open_gguf(path: Path):
    """A GGUFReader over `path`, or a one-line error: the reader fails in many ways on a cut or damaged file (a numpy
    reshape, a struct or index error), all of which mean the same to the user."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception:
        raise ConversionError(f"{path} ({path.stat().st_size} bytes) is truncated or is not a GGUF file: its header "
                              "and tensors cannot be parsed; download it again") from None


def read_config(reader) -> dict:
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"GGUF architecture is {arch!r}; only 'llama' is supported")
    p = "llama."
    n_heads = int(required(reader, p + "attention.head_count"))
    hidden = int(required(reader, p + "embedding_length"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ConversionError("the GGUF file has no 'tokenizer.ggml.tokens' field; it carries no tokenizer")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(field(reader, p + "vocab_size", len(tokens.data))),
        "hidden_size": hidden,
        "intermediate_size": int(required(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(required(reader, p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(field(reader, p + "attention.head_count_kv", n_heads)),
        "head_dim": int(field(reader, p + "rope.dimension_count", hidden // n_heads)),
        "max_position_embeddings": int(required(reader, p + "context_length")),
        "rms_norm_eps": float(required(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(reader, p + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not has_output,
        "bos_token_id": int(required(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(required(reader, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
    }
    if field(reader, p + "rope.scaling.type") not in (None, "none"):
        raise ConversionError("GGUF files with RoPE scaling are not supported by this converter")
    return config


def build_tokenizer(reader, out_dir: Path, config: dict) -> None:
    """Write tokenizer.json (byte-level BPE) and tokenizer_config.json from the GGUF's vocabulary and merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model_kind = field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ConversionError(f"GGUF tokenizer {model_kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tok_field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(tok_field.parts[i]).decode("utf-8") for i in tok_field.data]
    type_field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(type_field.parts[i][0]) for i in type_field.data]
    merge_field = reader.fields["tokenizer.ggml.merges"]
    merges = [tuple(bytes(merge_field.parts[i]).decode("utf-8").split(" ", 1)) for i in merge_field.data]

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM2's pre-tokenizer ("smollm" in llama.cpp): every digit on its own, then GPT-2's byte-level regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, ty in zip(tokens, types) if ty == GGUF_CONTROL_TOKEN]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out_dir / "tokenizer.json"))

    bos, eos = tokens[config["bos_token_id"]], tokens[config["eos_token_id"]]
    unk_id = field(reader, "tokenizer.ggml.unknown_token_id")
    pad_id = field(reader, "tokenizer.ggml.padding_token_id")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": tokens[int(unk_id)] if unk_id is not None else None,
        "pad_token": tokens[int(pad_id)] if pad_id is not None else None,
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "additional_special_tokens": [t for t in specials if t not in (bos, eos)],
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    template = field(reader, "tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Write the Hugging Face folder of `gguf_path` into `out_dir`; a ConversionError (one line) for a file that is
    missing, truncated, corrupt or not a Llama model."""
    if not gguf_path.is_file():
        raise ConversionError(f"no GGUF file at {gguf_path}; pass the path of a .gguf file")
    reader = open_gguf(gguf_path)
    try:
        _convert(reader, out_dir)
    except ConversionError as e:
        raise ConversionError(f"{gguf_path}: {e}") from None
    except KeyError as e:
        raise ConversionError(f"{gguf_path} lacks the field {e.args[0]!r}; it is not a complete llama.cpp model file")
    except ValueError as e:  # a tensor whose data does not match its declared type and shape
        raise ConversionError(f"{gguf_path} has a damaged tensor ({str(e)[:120]}); download it again")


def _convert(reader, out_dir: Path) -> None:
    from gguf.quants import dequantize

    config = read_config(reader)
    out_dir.mkdir(parents=True, exist_ok=True)

    tensors = {}
    for t in progress(reader.tensors, len(reader.tensors), "dequantizing"):
        name = hf_name(t.name)
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)  # HF [out, in] layout
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.array(w, copy=True))  # own, writable, contiguous
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    build_tokenizer(reader, out_dir, config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m weights_tools.gguf_to_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path, help="input .gguf file (Llama architecture, byte-level BPE tokenizer)")
    ap.add_argument("out_dir", type=Path, help="output Hugging Face folder (created)")
    args = ap.parse_args(argv)
    try:
        convert(args.gguf, args.out_dir)
    except OSError as e:
        raise UserError(f"cannot write {args.out_dir} ({e.strerror or e}); pick a writable output folder")
    print(f"wrote {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
