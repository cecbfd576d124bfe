"""Plain decoding with the static KV cache: prefill the prompt, then one token per forward, greedy or sampled.

This is the oracle for losslessness (speculative decoding must emit exactly these tokens, or with sampling exactly
this distribution) that the tests compare with, so it is kept lean and separate: one forward and one host sync per
token. The engine decodes plainly through the one driver instead (tr_engine/core/batch.py, a step with the root alone),
which gives these tokens too (bench.ab --method ar: 24/24 identical against this loop, 0.997x and 0.998x its speed).

The decode loops are generators: they yield each step's committed tokens as soon as the step is done (streaming),
and return the Generation. `run_to_end` drives one without streaming. Their `context_ids` are the whole sequence so
far; the cache may already hold a prefix of it (a conversation's earlier turns), and only the rest is prefilled.
"""

import time

import torch

from tr_engine.core.generation import Generation, run_to_end
from tr_engine.core.sampling import Sampler, greedy
from tr_engine.errors import UserError
from tr_engine.model.kv_cache import KVCache
from tr_engine.model.llama import Llama


@torch.inference_mode()
def prefill(model: Llama, cache: KVCache, prompt_ids: list[int], all_logits: bool = False) -> torch.Tensor:
    """Run the prompt after what is already cached and commit it; return the last position's logits [V], or every
    position's [T, V] when `all_logits`."""
    device = cache.data.device
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)  # [T]
    positions = torch.arange(cache.length, cache.length + len(prompt_ids), device=device)  # [T]
    logits = model(ids, positions, cache.data, cache.length, last_logits_only=not all_logits)  # [T or 1, V]
    if model.dtype == torch.float16 and not bool(torch.isfinite(logits[-1]).all()):
        raise UserError("the model's activations overflowed float16 (its logits are not finite); run it with "
                        "--dtype bfloat16 or float32")
    cache.length += len(prompt_ids)
    return logits if all_logits else logits[0]


def uncached(cache: KVCache, context_ids: list[int]) -> list[int]:
    """The part of the context the cache does not hold yet (at least its last token, whose logits start decoding)."""
    if not 0 <= cache.length < len(context_ids):
        raise ValueError(f"the cache holds {cache.length} tokens of a {len(context_ids)}-token context")
    return context_ids[cache.length :]


@torch.inference_mode()
def decode_step(model: Llama, cache: KVCache, token: torch.Tensor) -> torch.Tensor:
    """Feed one token (a tensor [1], on the cache's device) and commit it; return the logits [1, V] after it. (No
    view or select more than needed: right after a step, each small op costs tens of microseconds on a CPU.)"""
    position = torch.tensor([cache.length], device=cache.data.device)
    logits = model(token, position, cache.data, cache.length)  # [1, V]
    cache.length += 1
    return logits


def plain_steps(model: Llama, cache: KVCache, context_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...],
                sampler: Sampler | None = None):
    """Prefill what the cache lacks of `context_ids`, then decode one token per forward, the argmax or with `sampler`
    a sample, until an EOS id or `max_new_tokens` new tokens, yielding each token as a one-element list. Returns the
    Generation."""
    new = uncached(cache, context_ids)
    cache.check_room(len(new) + max_new_tokens, "the prompt plus --max-new-tokens")

    def pick(logits: torch.Tensor, j: int) -> torch.Tensor:
        # logits [1, V] -> the token, a tensor [1]. Greedy: it stays on the device until the host needs it. Sampled:
        # the sampler syncs.
        if sampler is None:
            return greedy(logits, model.ops)
        with torch.inference_mode():
            return torch.tensor([sampler.draw(logits[0], j)], device=logits.device)

    t0 = time.perf_counter()
    token = pick(prefill(model, cache, new)[None], 0)
    t1 = time.perf_counter()
    out, finish = [], "length"
    for _ in range(max_new_tokens):
        tid = int(token)  # the step's one host sync
        out.append(tid)
        yield [tid]
        if tid in eos_ids:
            finish = "eos"
            break
        if len(out) == max_new_tokens:
            break
        token = pick(decode_step(model, cache, token), len(out))
    t2 = time.perf_counter()
    # The last token is never fed back, so it is not in the cache: the next turn's prefill starts with it.
    steps = max(len(out) - 1, 0)
    return Generation(out, finish, len(new), t1 - t0, t2 - t1, steps, [1] * steps, {}, [1] * steps)


def plain_generate(
    model: Llama, cache: KVCache, context_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...],
    sampler: Sampler | None = None,
) -> Generation:
    """plain_steps without streaming."""
    return run_to_end(plain_steps(model, cache, context_ids, max_new_tokens, eos_ids, sampler))
