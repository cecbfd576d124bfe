"""Hand-made verify cost curves (tr_engine/core/cost.py): for the tests of the adaptive tree's choices, and for the
tests that decode with an adaptive tree but are not about its curve (measuring one takes seconds, and on a busy machine,
such as two test workers, is doubtful, left uncached and measured again by the next engine)."""

from tr_engine.core.cost import BUCKETS, PREFIXES, CostModel


def curve(fn) -> CostModel:
    """A hand-made cost curve: fn(T) plain steps for a T-token verify, at every prefix."""
    rel = [round(fn(T), 4) for T in BUCKETS]
    return CostModel(BUCKETS, PREFIXES, [rel, rel], [1.0, 1.0], {})


FREE = curve(lambda T: 1.0)  # a GPU with compute to spare: any tree costs one plain step
LINEAR = curve(lambda T: float(T))  # every token costs a plain step: nothing can pay
CPU_LIKE = curve(lambda T: 1.0 if T <= 2 else 1.0 + 0.08 * T)  # this machine's fp32 shape, roughly


def pinned(engine):
    """The engine, its adaptive trees priced by CPU_LIKE rather than by a curve measured first: the tests of the real
    model are about its tokens, not its curve (measured and tested on the tiny models, and on the default model by
    its chat in a subprocess), and a measurement costs it ~10 s, more on a busy machine."""
    engine.use_cost(CPU_LIKE)
    return engine
