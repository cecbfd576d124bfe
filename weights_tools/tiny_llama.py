"""Write a tiny random Llama as a Hugging Face folder, in the format real checkpoints use, for tests and examples:
config.json, safetensors weights (one file or shards with an index), and a tokenizer trained on the spot — byte-level
BPE `tokenizer.json` (SmolLM2/Llama-3 kind) or sentencepiece `tokenizer.model` (Llama-2/Vicuna kind).

    python -m weights_tools.tiny_llama OUT_DIR [--tokenizer bpe|sentencepiece] [--rope-scaling llama3] …
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from tr_engine.cli.args import integer
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.errors import UserError

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Token Recycling turns the candidate tokens a model discards into the drafts of its next steps.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 3.14159, 2026 and 42 are split digit by digit.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Unicode: café, naïve, Straße, 東京, 🙂 and 🚀.",
    "A chat between a curious user and an artificial intelligence assistant.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_bpe(out_dir: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": CHATML,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return tok.get_vocab_size()


def train_sentencepiece(out_dir: Path, vocab_size: int, corpus: list[str] | None = None) -> int:
    """Write tokenizer.model and tokenizer_config.json as Llama-2/Vicuna folders have them; returns the vocabulary
    size. With `corpus`, as many pieces as it yields up to `vocab_size` (a real text's merges run out before a
    32000-piece vocabulary does); without, exactly `vocab_size` pieces learned from CORPUS."""
    import sentencepiece as spm

    # Llama's trainer settings: BPE, byte fallback, digits split, no normalisation, whitespace kept as is.
    with tempfile.TemporaryDirectory() as tmp:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus or CORPUS * 20),
            model_prefix=f"{tmp}/tokenizer",
            vocab_size=vocab_size,
            hard_vocab_limit=corpus is None,
            model_type="bpe",
            byte_fallback=True,
            split_digits=True,
            character_coverage=1.0,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            minloglevel=2,
        )
        (out_dir / "tokenizer.model").write_bytes(Path(f"{tmp}/tokenizer.model").read_bytes())
        vocab_size = spm.SentencePieceProcessor(model_file=f"{tmp}/tokenizer.model").get_piece_size()
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return vocab_size


def write_tiny_llama(
    out_dir: str | Path,
    tokenizer: str = "bpe",
    vocab_size: int = 384,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    max_positions: int = 512,
    rope_scaling: str | None = None,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    shards: int = 1,
    std: float = 0.2,
    seed: int = 0,
) -> Path:
    """Write the folder and return its path. `std` is large enough that greedy choices are well separated."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bpe":
        vocab = train_bpe(out_dir, vocab_size)
        bos, eos = 1, 2  # <|im_start|>, <|im_end|>
    elif tokenizer == "sentencepiece":
        vocab = train_sentencepiece(out_dir, vocab_size)
        bos, eos = 1, 2  # <s>, </s>
    else:
        raise ValueError(f"tokenizer must be 'bpe' or 'sentencepiece', got {tokenizer!r}")
    head_dim = head_dim or hidden_size // num_heads
    scaling = {
        None: None,
        "linear": {"rope_type": "linear", "factor": 2.0},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64},
    }[rope_scaling]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": scaling,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype)

    E, Fd, Hq, Hkv, D = hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim
    weights = {"model.embed_tokens.weight": rand(vocab, E), "model.norm.weight": 1 + rand(E)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(Hq * D, E),
            p + "self_attn.k_proj.weight": rand(Hkv * D, E),
            p + "self_attn.v_proj.weight": rand(Hkv * D, E),
            p + "self_attn.o_proj.weight": rand(E, Hq * D),
            p + "mlp.gate_proj.weight": rand(Fd, E),
            p + "mlp.up_proj.weight": rand(Fd, E),
            p + "mlp.down_proj.weight": rand(E, Fd),
            p + "input_layernorm.weight": 1 + rand(E),
            p + "post_attention_layernorm.weight": 1 + rand(E),
        })
    if not tie_word_embeddings:
        weights["lm_head.weight"] = rand(vocab, E)
    save_weights(weights, out_dir, shards)
    gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out_dir


def save_weights(weights: dict, out_dir: Path, shards: int) -> None:
    """One model.safetensors, or `shards` files plus model.safetensors.index.json as Hugging Face shards them."""
    if shards <= 1:
        save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        filename = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in part}, str(out_dir / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in part})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m weights_tools.tiny_llama", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--tokenizer", choices=["bpe", "sentencepiece"], default="bpe")
    ap.add_argument("--vocab-size", type=integer(300, 100_000, "the trained tokenizer's range"), default=384)
    ap.add_argument("--hidden-size", type=integer(1, 8192), default=64)
    ap.add_argument("--intermediate-size", type=integer(1, 32768), default=128)
    ap.add_argument("--layers", type=integer(1, 128), default=2)
    ap.add_argument("--heads", type=integer(1, 256), default=4)
    ap.add_argument("--kv-heads", type=integer(1, 256), default=2)
    ap.add_argument("--head-dim", type=integer(2, 512), default=None)
    ap.add_argument("--max-positions", type=integer(1, 1 << 20), default=512)
    ap.add_argument("--rope-scaling", choices=["linear", "llama3"], default=None)
    ap.add_argument("--tie", action="store_true", help="tie the LM head to the embeddings")
    ap.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], default="float32")
    ap.add_argument("--shards", type=integer(1, 64), default=1)
    ap.add_argument("--seed", type=integer(0, 2**63 - 1), default=0)
    a = ap.parse_args(argv)
    head_dim = a.head_dim or a.hidden_size // a.heads
    if a.heads % a.kv_heads or head_dim % 2 or (a.head_dim is None and a.hidden_size % a.heads):
        raise UserError(f"--heads {a.heads} must be a multiple of --kv-heads {a.kv_heads}, and the head dim "
                        f"({head_dim}: --head-dim, or --hidden-size / --heads) even and exact")
    try:
        write_tiny_llama(a.out_dir, a.tokenizer, a.vocab_size, a.hidden_size, a.intermediate_size, a.layers, a.heads,
                         a.kv_heads, a.head_dim, a.max_positions, a.rope_scaling, a.tie, getattr(torch, a.dtype),
                         a.shards, seed=a.seed)
    except OSError as e:
        raise UserError(f"cannot write {a.out_dir} ({e.strerror or e}); pick a writable output folder")
    print(f"wrote {a.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
