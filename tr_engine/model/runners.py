"""Where the decode loops' forwards run and their K/V go: one sequence's cache (seen as a batch of one slot, which
remembers its conversation for the next call) and the batch's slots, each with its runner: the model itself, or on a
GPU its CUDA graphs (graphs.py). An engine owns one Runners; the batch's slots are allocated at the first batch."""

from tr_engine.model.graphs import BatchGraphs, StepGraphs, graph_buckets
from tr_engine.model.kv_cache import BatchKVCache, KVCache, check_memory
from tr_engine.model.llama import Llama


class Runners:
    """`max_context` tokens for one sequence; `max_batch` slots of `batch_context` tokens for batches (a size this
    machine cannot hold is refused now, before anything is allocated or measured)."""

    def __init__(self, model: Llama, max_context: int, max_batch: int, batch_context: int):
        self.model = model
        self.cache = KVCache(model.local_config, max_context, model.dtype, model.device)  # (this rank's KV heads)
        self.slot = BatchKVCache.of(self.cache)  # the cache as a batch of one, remembering its conversation
        model.set_max_positions(max_context)
        self.runner = model  # what one sequence's forwards run through: the model, or its CUDA graphs
        self.max_batch, self.batch_context = max_batch, batch_context
        check_memory(BatchKVCache.shape(model.local_config, max_batch, batch_context), model.dtype, model.device,
                     BatchKVCache.flags(max_batch, batch_context))
        self.batch: BatchKVCache | None = None  # (batch_cache())
        self.batch_runner = model  # what a batch's forwards run through
        self.graphs = None  # (use_graphs: the verify sizes and the static tree's)

    def use_graphs(self, sizes, tree_size: int, capture: bool = True) -> None:
        """Replay CUDA graphs from now on: one per bucket of `sizes` (verify sizes) up to what a `tree_size` tree
        needs, for one sequence's steps and for the batch's (whose slots are allocated again, with a scratch slot).
        Without `capture`, the same static-buffer steps run eagerly: the CPU's rehearsal of the graph path."""
        self.graphs = sizes, tree_size, capture
        self.runner = StepGraphs(self.model, self.cache, graph_buckets(sizes, tree_size, self.cache.capacity), capture)
        self.batch, self.batch_runner = None, self.model

    def batch_cache(self) -> BatchKVCache:
        """The batch's slots, allocated at the first call, with their runner (batch_runner)."""
        if self.batch is None:
            m = self.model
            self.batch = BatchKVCache(m.local_config, self.max_batch, self.batch_context, m.dtype, m.device,
                                      scratch=self.graphs is not None)  # (a scratch slot takes graphs' padding rows)
            if self.graphs is not None:
                sizes, tree_size, capture = self.graphs
                self.batch_runner = BatchGraphs(m, self.batch, graph_buckets(sizes, tree_size, self.batch_context),
                                                capture)
        return self.batch
