"""Plain greedy decoding with the static KV cache: prefill the prompt, then one token per forward.

This is the oracle for losslessness (speculative decoding must emit exactly these tokens) and the baseline every
speedup is measured against, so it is kept lean: one forward and one host sync per token.
"""

import time
from dataclasses import dataclass, field

import torch

from tr_engine.kv_cache import KVCache
from tr_engine.model import Llama


@dataclass
class Generation:
    """What one call generated: the new ids (ending with the EOS id when finish_reason == 'eos') and its timings."""

    token_ids: list[int]
    finish_reason: str  # "eos" or "length"
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    steps: int  # forwards after the prefill
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed by each step
    phase_s: dict[str, float] = field(default_factory=dict)  # decode seconds by phase (speculative methods)


def prefill(model: Llama, cache: KVCache, prompt_ids: list[int], all_logits: bool = False) -> torch.Tensor:
    """Run the prompt after what is already cached and commit it; return the last position's logits [V], or every
    position's [T, V] when `all_logits`."""
    device = cache.data.device
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)  # [T]
    positions = torch.arange(cache.length, cache.length + len(prompt_ids), device=device)  # [T]
    logits = model(ids, positions, cache.data, cache.length, last_logits_only=not all_logits)  # [T or 1, V]
    cache.length += len(prompt_ids)
    return logits if all_logits else logits[0]


@torch.inference_mode()
def greedy_generate(
    model: Llama, cache: KVCache, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]
) -> Generation:
    """Append `prompt_ids` to the cache and decode greedily until an EOS id or `max_new_tokens` new tokens."""
    cache.check_room(len(prompt_ids) + max_new_tokens, "the prompt plus --max-new-tokens")
    t0 = time.perf_counter()
    logits = prefill(model, cache, prompt_ids)
    t1 = time.perf_counter()
    device = cache.data.device
    out, finish = [], "length"
    token = logits.argmax()  # tensor [], stays on the device until the host needs it
    for _ in range(max_new_tokens):
        tid = int(token)  # the step's one host sync
        out.append(tid)
        if tid in eos_ids:
            finish = "eos"
            break
        if len(out) == max_new_tokens:
            break
        position = torch.tensor([cache.length], device=device)
        logits = model(token.view(1), position, cache.data, cache.length)  # [1, V]
        cache.length += 1
        token = logits[0].argmax()
    t2 = time.perf_counter()
    # The last token is never fed back, so it is not in the cache: the next turn's prefill starts with it.
    steps = max(len(out) - 1, 0)
    return Generation(out, finish, len(prompt_ids), t1 - t0, t2 - t1, steps, [1] * steps)
