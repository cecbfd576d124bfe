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

With `capture=False` the same padded, static-buffer steps run without a graph: on a CPU this is the rehearsal of the
graph path that CI runs (tests/test_graphs.py), since capturing needs a GPU.
"""

import torch

from tr_engine.errors import warn
from tr_engine.model.kv_cache import KVCache
from tr_engine.model.llama import Llama


class StepGraphs:
    """Callable like the model (same arguments), for the decode loops and the cost curve: steps of at most the largest
    bucket replay a graph, everything else goes to the model itself."""

    def __init__(self, model: Llama, cache: KVCache, buckets, capture: bool = True):
        self.model, self.cache, self.capture = model, cache, capture
        self.buckets = tuple(sorted(set(buckets)))
        device = cache.data.device
        self.start = torch.zeros(1, dtype=torch.long, device=device)  # the prefix length every graph reads
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # bucket -> ids, positions, mask
        self.eye: dict[int, torch.Tensor] = {}  # bucket -> its empty mask (each row sees itself only)
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

    def bucket(self, T: int, start: int) -> int | None:
        """The bucket a step of T tokens at `start` runs in, or None to run it eagerly."""
        b = next((b for b in self.buckets if b >= T), None)
        if b is None or start + b > self.cache.capacity or b in self.failures:
            return None
        return b

    def __call__(self, input_ids, positions, kv_cache, start, tree_mask=None, last_logits_only=False, gather=True):
        T = input_ids.shape[0]  # (`gather`: the model's forward's; one device's logits are whole either way)
        stepping = kv_cache is self.cache.data and not last_logits_only and (tree_mask is not None or T == 1)
        b = self.bucket(T, start) if stepping else None
        if b is None:
            self.counts["eager"] += 1
            return self.model(input_ids, positions, kv_cache, start, tree_mask, last_logits_only)
        self._fill(b, input_ids, positions, start, tree_mask)
        if not self.capture:
            self.counts["graph"] += 1
            return self._forward(b)[:T]
        if b not in self.graphs:
            try:
                self._capture(b)
            except RuntimeError as e:
                self.failures[b] = str(e).splitlines()[0]
                warn(f"CUDA graph capture failed for {b}-token steps; they run without a graph ({self.failures[b]})")
                self.counts["eager"] += 1
                return self.model(input_ids, positions, kv_cache, start, tree_mask, last_logits_only)
        graph, logits = self.graphs[b]
        graph.replay()
        self.counts["graph"] += 1
        return logits[:T].clone()  # the buffer is the graph's: the next replay overwrites it

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


def graph_buckets(sizes, static_tree_size: int, capacity: int) -> tuple[int, ...]:
    """The buckets an engine captures: the adaptive tree's sizes (tr_engine/core/cost.py BUCKETS) and its static tree's,
    those that fit the cache."""
    return tuple(sorted({T for T in (*sizes, static_tree_size) if T <= capacity}))
