"""Hugging Face transformers as the reference Llama, for parity tests."""

import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama


def _rms_norm_keep_float64(self, hidden_states):
    # transformers normalises in float32 even for float64 models; float64 parity needs the norm in float64 too.
    # For float32/bf16/fp16 this is exactly transformers' own computation.
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.float64 if dtype == torch.float64 else torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(dtype)


def load_hf(folder, dtype=torch.float32):
    modeling_llama.LlamaRMSNorm.forward = _rms_norm_keep_float64
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V] logits of a full causal forward."""
    return model(torch.tensor([ids])).logits[0]
