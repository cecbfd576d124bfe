"""CUDA graphs for the decode loop's forwards: the plain decode step and the verify of each tree-size bucket, each
captured once and replayed at every later step.

Why: a 7B step launches about 15 kernels per layer, some 500 in all, and each launch costs microseconds of Python and
driver work, so the host alone can take as long as the ~3 ms the GPU needs to read the weights. A graph launches them
all at once. Capture fixes every shape and every address, so a step is made replayable:

- its inputs live in static buffers that each step refills: token ids, positions, the tree mask, and the prefix
  length as a one-element device tensor. Given that tensor as `start`, the model's forward writes K/V with
  index_copy_ and attends with tree_attention_dynamic, whose kernel reads the length: nothing on the host depends on
  where in the cache the step is;
- a tree of n tokens runs in the smallest bucket of at least n tokens. The padding rows see the prefix and
  themselves only, and no real row sees them, so the real rows get exactly their unpadded logits (bit for bit on a
  CPU, whose kernels are row-independent); their K/V land in free slots past the tree, which compaction never reads;
- a plain step is a one-node tree, bucket 1.

Prefill (causal chunks) and any step whose bucket would run past the cache's end run eagerly. A bucket whose capture
fails runs eagerly from then on, and says why once (`failures`).

A batch's steps (tr_engine/core/batch.py: the server, --prompts-file) replay graphs too (BatchGraphs): a step of n
tokens over all its sequences runs in the smallest bucket of at least n, every row's place (its slot, its sequence's
prefix length and first row, the cache position its K/V go to) in static tensors the attention kernel reads on the
device (RowBatch, the ops' tree_attention_rows), so one graph per bucket serves any mix of sequences, prefixes and
trees. Padding rows go to a scratch slot of the batch's cache that no sequence takes. One sequence's step in a slot of
that cache (a batch down to one) is the same with one sequence.

With `capture=False` the same padded, static-buffer steps run without a graph: on a CPU this is the rehearsal of the
graph path that CI runs (tests/test_graphs.py), since capturing needs a GPU.
"""

import torch

from tr_engine.errors import warn
from tr_engine.model.kv_cache import BatchKVCache, KVCache
from tr_engine.model.llama import Llama, RaggedBatch, RowBatch


class Graphs:
    """What the two runners share: callable like the model, a graph per bucket captured at its first step (or, once
    its capture failed, eager steps), replayed after; without `capture`, the same static-buffer steps eagerly."""

    def __init__(self, model: Llama, buckets, capture: bool):
        self.model, self.capture = model, capture
        self.buckets = tuple(sorted(set(buckets)))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> graph, its logits buffer
        self.failures: dict[int, str] = {}  # bucket -> why its capture failed (it runs eagerly)
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for all the graphs
        self.counts = {"graph": 0, "eager": 0}  # steps served each way (for the benchmarks and tests)

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def shard(self):
        return self.model.shard  # (always the whole model: the engine refuses CUDA graphs with --tp)

    @property
    def ops(self):
        return self.model.ops  # (the decode loops' greedy choice reads them)

    @property
    def chunks_exact(self) -> bool:
        return self.model.chunks_exact  # (a GPU's: False)

    def smallest(self, T: int, room: int) -> int | None:
        """The bucket of a T-token step with `room` positions for it, or None to run it eagerly."""
        b = next((b for b in self.buckets if b >= T), None)
        return None if b is None or b > room or b in self.failures else b

    def eager(self, *args, **kwargs) -> torch.Tensor:
        self.counts["eager"] += 1
        return self.model(*args, **kwargs)

    def replay(self, b: int, T: int, eager) -> torch.Tensor:
        """Bucket b's step on its filled buffers: its first T rows' logits (`eager()` if its capture fails)."""
        if not self.capture:
            self.counts["graph"] += 1
            return self._forward(b)[:T]
        if b not in self.graphs:
            try:
                self._capture(b)
            except RuntimeError as e:
                self.failures[b] = str(e).splitlines()[0]
                warn(f"CUDA graph capture failed for {b}-token steps; they run without a graph ({self.failures[b]})")
                return eager()
        graph, logits = self.graphs[b]
        graph.replay()
        self.counts["graph"] += 1
        return logits[:T].clone()  # the buffer is the graph's: the next replay overwrites it

    def _forward(self, b: int) -> torch.Tensor:
        raise NotImplementedError

    def _capture(self, b: int) -> None:
        # One eager run on a side stream first, as PyTorch asks: lazy initialisation (cuBLAS handles and workspaces)
        # must not happen inside a capture. It computes this very step, into slots that are free until it runs.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(b)
        self.graphs[b] = (graph, logits)


class StepGraphs(Graphs):
    """One sequence's cache: steps of at most the largest bucket replay a graph, everything else goes to the model
    itself."""

    def __init__(self, model: Llama, cache: KVCache, buckets, capture: bool = True):
        super().__init__(model, buckets, capture)
        self.cache = cache
        device = cache.data.device
        self.start = torch.zeros(1, dtype=torch.long, device=device)  # the prefix length every graph reads
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # bucket -> ids, positions, mask
        self.eye: dict[int, torch.Tensor] = {}  # bucket -> its empty mask (each row sees itself only)

    def bucket(self, T: int, start: int) -> int | None:
        """The bucket a step of T tokens at `start` runs in, or None to run it eagerly."""
        return self.smallest(T, self.cache.capacity - start)

    def __call__(self, input_ids, positions, kv_cache, start, tree_mask=None, last_logits_only=False, gather=True):
        T = input_ids.shape[0]  # (`gather`: the model's forward's; one device's logits are whole either way)
        stepping = kv_cache is self.cache.data and not last_logits_only and (tree_mask is not None or T == 1)
        b = self.bucket(T, start) if stepping else None
        eager = lambda: self.eager(input_ids, positions, kv_cache, start, tree_mask, last_logits_only)  # noqa: E731
        if b is None:
            return eager()
        self._fill(b, input_ids, positions, start, tree_mask)
        return self.replay(b, T, eager)

    def _fill(self, b: int, input_ids, positions, start: int, tree_mask) -> None:
        if b not in self.inputs:
            device = self.cache.data.device
            self.eye[b] = torch.eye(b, dtype=torch.bool, device=device)
            self.inputs[b] = (torch.zeros(b, dtype=torch.long, device=device),
                              torch.zeros(b, dtype=torch.long, device=device), self.eye[b].clone())
        ids, pos, mask = self.inputs[b]
        T = input_ids.shape[0]
        # Padding rows keep the ids and positions of an earlier step (valid ones: any will do, no real row sees them).
        ids[:T].copy_(input_ids)
        pos[:T].copy_(positions)
        mask.copy_(self.eye[b])  # padding rows see themselves only (a plain step's [[True]] is the eye's too)
        if tree_mask is not None:
            mask[:T, :T].copy_(tree_mask)
        self.start.fill_(start)

    def _forward(self, b: int) -> torch.Tensor:
        ids, pos, mask = self.inputs[b]
        return self.model(ids, pos, self.cache.data, self.start, tree_mask=mask)


class BatchGraphs(Graphs):
    """A batch's cache (one with a scratch slot): a batched verify (`batch=`, a RaggedBatch) or one sequence's step in
    one of its slots, of at most the largest bucket's tokens in all, replays that bucket's graph; prefills and
    anything bigger go to the model itself."""

    def __init__(self, model: Llama, cache: BatchKVCache, buckets, capture: bool = True):
        if cache.scratch is None:
            raise ValueError("BatchGraphs needs a batch cache with a scratch slot (BatchKVCache(scratch=True))")
        super().__init__(model, buckets, capture)
        self.cache = cache
        self.slot_of = {id(view.data): s for s, view in enumerate(cache.views)}  # a slot's view -> the slot
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, input_ids, positions, kv_cache, start, tree_mask=None, last_logits_only=False, batch=None,
                 gather=True):
        T = input_ids.shape[0]
        slot = self.slot_of.get(id(kv_cache))
        if batch is not None and kv_cache is self.cache.data and isinstance(batch, RaggedBatch):
            places = batch.slots, batch.prefix_lens, batch.offsets, batch.tree_masks
        elif slot is not None and not last_logits_only and (tree_mask is not None or T == 1):
            flat = tree_mask.reshape(-1) if tree_mask is not None else input_ids.new_ones(1, dtype=torch.bool)
            places = [slot], [int(start)], [0, T], flat
        else:
            places = None
        b = self.smallest(T, self.cache.capacity) if places is not None else None
        eager = lambda: self.eager(input_ids, positions, kv_cache, start, tree_mask, last_logits_only,  # noqa: E731
                                   batch=batch)
        if b is None:
            return eager()
        self._fill(b, input_ids, positions, *places)
        return self.replay(b, T, eager)

    def _fill(self, b: int, input_ids, positions, slots, prefix_lens, offsets, tree_masks) -> None:
        """Bucket b's buffers: sequence i's rows offsets[i].. in slot slots[i] after prefix_lens[i] cached tokens,
        seeing its tree mask's block; then b - T padding rows, a sequence of their own at the scratch slot's start,
        each seeing itself only."""
        device = self.cache.data.device
        if b not in self.inputs:
            self.inputs[b] = (torch.zeros(b, dtype=torch.long, device=device),  # ids
                              torch.zeros(b, dtype=torch.long, device=device),  # positions (RoPE's)
                              torch.zeros(b, 5, dtype=torch.long, device=device),  # seq, pos, then rows [b, 3]
                              torch.zeros(b, b, dtype=torch.bool, device=device))  # mask
        ids, pos, places, mask = self.inputs[b]
        T = input_ids.shape[0]
        host = torch.empty(b, 5, dtype=torch.long)
        mask.zero_()
        at = 0
        for slot, prefix, lo, hi in zip(slots, prefix_lens, offsets, offsets[1:]):
            n = hi - lo
            host[lo:hi] = torch.tensor([slot, prefix, slot, prefix, lo])
            host[lo:hi, 1] += torch.arange(n)
            mask[lo:hi, lo:hi].copy_(tree_masks[at : at + n * n].view(n, n))
            at += n * n
        host[T:] = torch.tensor([self.cache.scratch, 0, self.cache.scratch, 0, T])
        host[T:, 1] = torch.arange(b - T)
        mask[T:, T:].fill_diagonal_(True)
        places.copy_(host)
        ids[:T].copy_(input_ids)  # padding rows keep an earlier step's ids (valid ones: no real row sees them)
        pos[:T].copy_(positions)
        pos[T:].copy_(host[T:, 1])

    def _forward(self, b: int) -> torch.Tensor:
        ids, pos, places, mask = self.inputs[b]
        rows = RowBatch(seq=places[:, 0], pos=places[:, 1], rows=places[:, 2:], tree_mask=mask)
        return self.model(ids, pos, self.cache.data, 0, batch=rows)


def graph_buckets(sizes, static_tree_size: int, capacity: int) -> tuple[int, ...]:
    """The buckets an engine captures: the adaptive tree's sizes (tr_engine/core/cost.py BUCKETS) and its static tree's,
    those that fit the cache."""
    return tuple(sorted({T for T in (*sizes, static_tree_size) if T <= capacity}))
