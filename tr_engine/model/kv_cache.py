"""The KV cache: one preallocated tensor for all layers, [L, 2 (k, v), Hkv, S, D], plus a host-side length.

Slots 0..length-1 hold the committed sequence. A forward writes its new tokens at slots length.., and the decode loop
either commits them (causal input) or compacts the accepted ones (a tree) with one op over all layers.
"""

import torch

from tr_engine.errors import ContextOverflow, UserError
from tr_engine.model.config import LlamaConfig


def available_bytes(device) -> int | None:
    """Memory free for a new tensor on `device`: a GPU's free memory, or on a CPU the kernel's MemAvailable (None
    where neither can be read)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(shape: tuple[int, ...], dtype: torch.dtype, device, flags: str) -> None:
    """Refuse, before allocating it, a cache of `shape` that the device has no memory for, naming the `flags` that
    size it (the zeros would otherwise fail deep inside the allocator, or make the machine swap)."""
    need = dtype.itemsize
    for n in shape:
        need *= n
    free = available_bytes(device)
    if free is not None and need > free:
        raise UserError(f"the KV cache for {flags} needs {need / 2**30:.1f} GiB but {torch.device(device)} has "
                        f"{free / 2**30:.1f} GiB free; lower them (or pick a smaller --dtype)")


class KVCache:
    def __init__(self, config: LlamaConfig, capacity: int, dtype: torch.dtype, device):
        shape = (config.num_hidden_layers, 2, config.num_key_value_heads, capacity, config.head_dim)
        check_memory(shape, dtype, device, f"--max-context {capacity}")
        self.data = torch.zeros(shape, dtype=dtype, device=device)  # [L, 2, Hkv, S, D]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    def check_room(self, n_tokens: int, what: str = "this request", start: int | None = None) -> None:
        """Raise a one-line error unless `n_tokens` more tokens fit after the committed ones (or after `start`)."""
        start = self.length if start is None else start
        if start + n_tokens > self.capacity:
            raise ContextOverflow(
                f"{what} needs {start + n_tokens} tokens of context but the cache holds {self.capacity}; "
                "shorten the prompt, lower --max-new-tokens, or raise --max-context (up to the model's limit)"
            )

    def reset(self) -> None:
        self.length = 0

    @classmethod
    def over(cls, data: torch.Tensor) -> "KVCache":
        """A cache over an existing [L, 2, Hkv, S, D] tensor (one slot of a BatchKVCache), empty."""
        cache = cls.__new__(cls)
        cache.data, cache.length = data, 0
        return cache


class BatchKVCache:
    """The caches of up to N sequences decoded together: one tensor [N, L, 2, Hkv, S, D], slot b a contiguous
    [L, 2, Hkv, S, D] cache of its own (view(b), a KVCache with its own length: prefill and compaction work on it as
    on a single sequence's), and a batched forward reads and writes every slot at once (model.RaggedBatch).

    A free slot remembers the tokens it holds (give_back's `ids`), so that a request whose prompt starts with them
    (the next turn of the same conversation, a shared system prompt) can take it and prefill only the rest: take(ids)
    picks the free slot that shares the longest prefix with `ids`, or else the least recently used one (LRU: the
    conversations most recently served stay longest)."""

    def __init__(self, config: LlamaConfig, slots: int, capacity: int, dtype: torch.dtype, device,
                 scratch: bool = False):
        """`scratch`: one more slot, never taken, where a padded step's padding rows write (BatchGraphs)."""
        shape = self.shape(config, slots, capacity, scratch)
        check_memory(shape, dtype, device, self.flags(slots, capacity))
        self._setup(torch.zeros(shape, dtype=dtype, device=device), slots, scratch)

    @staticmethod
    def shape(config: LlamaConfig, slots: int, capacity: int, scratch: bool = False) -> tuple[int, ...]:
        return slots + scratch, config.num_hidden_layers, 2, config.num_key_value_heads, capacity, config.head_dim

    @staticmethod
    def flags(slots: int, capacity: int) -> str:
        """The flags that size a batch's caches, for an error about their memory."""
        return f"--batch {slots} of --max-context {capacity} each"

    @classmethod
    def of(cls, cache: KVCache) -> "BatchKVCache":
        """One sequence's cache as a batch of one slot (the engine's own: a single request runs through the batch
        loop), what it holds forgotten."""
        batch = cls.__new__(cls)
        batch._setup(cache.data.unsqueeze(0), 1, False)
        batch.views = [cache]
        cache.length = 0
        return batch

    def _setup(self, data: torch.Tensor, slots: int, scratch: bool) -> None:
        self.data = data
        self.views = [KVCache.over(self.data[b]) for b in range(slots)]
        self.scratch = slots if scratch else None
        self._free = list(range(slots))
        self.held: list[list[int]] = [[] for _ in range(slots)]  # a free slot's tokens (its K/V at 0..len-1)
        self._used = [0] * slots  # when each slot was last given back (a count): LRU's order
        self._clock = 0

    @property
    def slots(self) -> int:
        return len(self.views)

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def view(self, slot: int) -> KVCache:
        return self.views[slot]

    def free(self) -> int:
        """How many slots are free."""
        return len(self._free)

    def take(self, ids: list[int] | None = None) -> int:
        """A free slot, now in use. Without `ids`: the lowest, emptied. With `ids` (a prompt): the one whose tokens
        share the longest prefix with them, its length set to what it can keep (at most all of `ids` but the last,
        whose logits the prefill must compute), else the least recently used one, emptied."""
        if ids is None:
            slot = min(self._free)
            keep = 0
        else:
            keeps = {s: max(min(shared_prefix(self.held[s], ids), len(ids) - 1), 0) for s in self._free}
            # the longest reuse (of two equal, the more recent); when none reuses anything, the least recent
            slot = max(self._free, key=lambda s: (keeps[s], self._used[s] if keeps[s] else -self._used[s]))
            keep = keeps[slot]
        self._free.remove(slot)
        self.held[slot] = []
        self.views[slot].length = keep
        return slot

    def forget(self) -> None:
        """Empty every slot (none in use): nothing is reused any more."""
        for slot, view in enumerate(self.views):
            view.length, self.held[slot] = 0, []

    def give_back(self, slot: int, ids: list[int] = ()) -> None:
        """Free `slot`; `ids`: the tokens its K/V hold from position 0 (kept for a later take(ids) to reuse)."""
        self._clock += 1
        self._used[slot] = self._clock
        self.held[slot] = list(ids)[: self.views[slot].length]
        self._free.append(slot)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
