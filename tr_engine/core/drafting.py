"""What an engine drafts with, in one place: the recycling matrix it keeps for its lifetime (hot start across calls
and requests), its static tree, the verify cost curve that prices the adaptive trees (measured once on this machine
and cached on disk: tr_engine/core/cost.py), and one drafter per method, all on that one matrix. The Engine
(tr_engine/engine.py) hands these out through its public calls; a benchmark builds more side by side with
new_drafter, each with state of its own.
"""

from pathlib import Path

from tr_engine.core.adaptive import AdaptiveTrees
from tr_engine.core.cost import BUCKETS, CostModel, calibrated, cost_path
from tr_engine.core.drafters import DrafterSetup
from tr_engine.core.matrix import RecyclingMatrix
from tr_engine.core.methods import ADAPTIVE, DRAFTERS, drafter_class
from tr_engine.core.suffix import BYTES_PER_TOKEN, SuffixIndex, beside
from tr_engine.core.tree import DraftTree, load_tree
from tr_engine.errors import InvalidType, InvalidValue, MatrixFileError, UserError
from tr_engine.model.llama import Llama


class Drafting:
    """The matrix, the trees, the cost curve and the suffix index of one model on one cache (`key`: what the curve
    depends on, cost.cost_key; `home`: the folder whose costs/ caches it; `suffix_bytes`: the suffix index's bound,
    0 for none; `max_draft`: the most draft tokens a step verifies, None for the trees' own limits)."""

    def __init__(self, model: Llama, cache, key: dict, home: Path, tree: str = ADAPTIVE, matrix_k: int = 8,
                 suffix_bytes: int = 0, max_draft: int | None = None):
        self.model, self.cache, self.key, self.home = model, cache, key, home
        self.max_tokens = BUCKETS[-1] if max_draft is None else max_draft + 1  # a verify's tokens, the root included
        self.matrix = RecyclingMatrix(model.config.vocab_size, matrix_k, model.device, model.ops)
        # Every finished request's tokens, for hybrid's drafts (tr_engine/core/suffix.py), shared like the matrix.
        self.suffix = SuffixIndex(model.config.vocab_size, suffix_bytes) if suffix_bytes else None
        self.tree_spec, self.matrix_k = tree, matrix_k
        self.tree: DraftTree = load_tree("2.2.2" if tree == ADAPTIVE else tree, matrix_k)  # static (adaptive: unused)
        if tree != ADAPTIVE and self.tree.size >= cache.capacity:  # near the end a tree is cut to fit; not all of it
            raise InvalidValue(f"the draft tree verifies {self.tree.size} tokens a step but the cache holds only "
                               f"{cache.capacity}; use a smaller --tree or raise --max-context")
        self.cost: CostModel | None = None  # what prices the adaptive trees (measured or loaded at first use)
        self.drafters = {}  # method -> its drafter on the shared matrix (drafter())

    def drafter(self, method: str):
        """The drafter for `method`, made on first use; the drafters of methods that keep a recycling matrix share
        this one's."""
        if method not in self.drafters:
            self.drafters[method] = self.new_drafter(method, matrix=self.matrix, suffix=self.suffix)
        return self.drafters[method]

    def new_drafter(self, method: str, tree: str | None = None, matrix: RecyclingMatrix | None = None,
                    cost: CostModel | None = None, max_tokens: int | None = None, suffix: SuffixIndex | None = None):
        """A drafter for `method` with the tree setting `tree` (default this one's), drafting from `matrix` (default a
        new, empty one) and, for hybrid, from the suffix index `suffix` (default none); an adaptive tree priced by
        this curve, or by `cost` pinned; every verify at most `max_tokens` tokens (default this one's)."""
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        if method not in DRAFTERS:
            raise UserError(f"no drafter for method {method!r}; choose one of {', '.join(DRAFTERS)}")
        tree = tree or self.tree_spec
        device = self.cache.data.device
        k = self.matrix_k if matrix is None else matrix.k
        static = self.tree if tree in (self.tree_spec, ADAPTIVE) else load_tree(tree, k)

        def new_matrix() -> RecyclingMatrix:
            return matrix if matrix is not None else RecyclingMatrix(self.model.config.vocab_size, k, device,
                                                                     self.model.ops)

        def new_adaptive() -> AdaptiveTrees | None:
            if tree != ADAPTIVE:
                return None
            return AdaptiveTrees(cost, max_tokens, device=device, pinned=cost is not None, shard=self.model.shard)

        return drafter_class(method).build(DrafterSetup(device, static, new_matrix, new_adaptive, suffix, max_tokens))

    def cost_model(self, runner, recalibrate: bool = False, notify=None) -> tuple[CostModel, bool]:
        """The curve, and whether it was measured now (through `runner`, the model or its CUDA graphs, in the cache,
        which it overwrote): loaded from the home's costs/ folder, or measured and saved there unless doubtful
        (tr_engine/core/cost.py: calibrated)."""
        measured = False
        if self.cost is None or recalibrate:
            self.cost, measured = calibrated(runner, self.cache, self.key, cost_path(self.home, self.key),
                                             self.model.shard, self.matrix_k, notify, recalibrate)
        return self.cost, measured

    def save_matrix(self, path, fingerprint: str) -> None:
        """The matrix at `path`, and the suffix index (if this engine keeps one) beside it (suffix.beside)."""
        self.matrix.save(path, fingerprint)
        if self.suffix is not None:
            self.suffix.save(beside(path), fingerprint)

    def load_matrix(self, path, fingerprint: str) -> None:
        """The saved matrix at `path` in place of this one's (checked: MatrixFileError when it is not a matrix for
        this model, tokenizer and k)."""
        loaded = RecyclingMatrix.load(path, self.model.config.vocab_size, fingerprint, self.matrix.table.device)
        if loaded.k != self.matrix.k:
            raise MatrixFileError(f"{path} keeps {loaded.k} candidates per token but --matrix-k is {self.matrix.k}; "
                                  "pass the matching --matrix-k or use another --matrix file")
        self.matrix.copy_(loaded.table, loaded.confidence)
        if self.suffix is not None and beside(path).is_file():  # (a matrix saved without an index: none to load)
            self.suffix.copy_(SuffixIndex.load(beside(path), self.model.config.vocab_size, fingerprint,
                                               self.suffix.capacity * BYTES_PER_TOKEN))

    @staticmethod
    def priced(drafter, cost_model):
        """The drafter, its adaptive tree (if any) pricing its steps by `cost_model()` (the engine's curve: measured at
        first use, a few seconds that overwrite the KV cache), unless it was given a curve of its own."""
        adaptive = getattr(drafter, "adaptive", None)
        if adaptive is not None and not adaptive.pinned:
            adaptive.cost = cost_model()
        return drafter

    def use_cost(self, cost: CostModel) -> None:
        if not isinstance(cost, CostModel):
            raise InvalidType(f"cost must be a CostModel, got {type(cost).__name__}")
        self.cost = cost


def seeder(drafter, seed_from_prompt: bool):
    """What receives a prompt's prefill logits to seed the recycling matrix (--seed-from-prompt): the drafter's
    matrix's seed_, or None (not asked for, or a drafter without a matrix)."""
    matrix = getattr(drafter, "matrix", None)
    return matrix.seed_ if seed_from_prompt and matrix is not None else None
