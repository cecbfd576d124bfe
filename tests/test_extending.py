"""Extending the engine, each in one place: a drafter is one class and one registry line (tr_engine.core.methods), and
one op is swapped for its reference by the ops spec, which reaches every caller through one namespace
(tr_engine.model.ops)."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tr_engine.core.drafters import Draft, DrafterSetup
from tr_engine.core.methods import DRAFTERS, register_drafter
from tr_engine.core.tree import chain_tree
from tr_engine.engine import Engine
from tr_engine.errors import InvalidType, InvalidValue
from tr_engine.model import reference
from tr_engine.model.ops import is_compiled, load_ops


class Bigram:
    """A toy drafter: a chain of three from the last token, each the token the model last predicted after the one
    before (Token Recycling with one candidate per token, a chain for a tree, and a dict for the matrix)."""

    name = "bigram"

    def __init__(self, device):
        self.next, self.tree = {}, chain_tree(3).to(device)

    @classmethod
    def build(cls, setup: DrafterSetup) -> "Bigram":
        return cls(setup.device)

    def propose(self, history: list[int]) -> Draft:
        tokens = [history[-1]]
        for _ in range(3):
            tokens.append(self.next.get(tokens[-1], 0))
        return Draft(self.tree, torch.tensor(tokens, device=self.tree.parent.device), history[-1], len(history))

    def learn(self, draft: Draft, committed: list[int], seconds: float = 0.0) -> None:
        pass

    def recycle(self, draft: Draft, logits: torch.Tensor) -> None:
        self.next.update(zip(draft.tokens.tolist(), logits.argmax(dim=-1).tolist()))


@pytest.fixture
def bigram_registered():
    register_drafter("bigram", Bigram)  # the one line a new drafter adds (here from outside the package)
    yield
    DRAFTERS.pop("bigram")


@pytest.fixture(scope="module")
def peaky(tiny_factory):
    # A peaky model: a token's next one is often the same wherever it occurs, so drafts come true and accepted paths
    # are compacted.
    return str(tiny_factory("peaky", dtype=torch.float64, vocab_size=300, std=0.5))


def test_a_registered_drafter_runs_through_the_engine(peaky, bigram_registered):
    engine = Engine.from_pretrained(peaky, dtype="float64")
    ar = engine.generate("hello hello", max_new_tokens=40, method="ar")
    cold = engine.generate("hello hello", max_new_tokens=40, method="bigram")
    hot = engine.generate("hello hello", max_new_tokens=40, method="bigram")  # the engine keeps its drafter: hot
    assert cold.token_ids == hot.token_ids == ar.token_ids  # lossless whatever the drafter proposes
    g = hot.generation
    assert g.steps < ar.generation.steps  # its drafts came true: they were really verified, and recycled
    assert set(g.verify_tokens[:-1]) == {4}  # every step but the last (cut at max_new_tokens) verified its chain
    with pytest.raises(InvalidValue, match="bigram"):  # gone from the registry, gone from the engine
        DRAFTERS.pop("bigram")
        engine.generate("hello", max_new_tokens=4, method="bigram")
    DRAFTERS["bigram"] = Bigram


def test_registering_ar_or_a_blank_name_is_refused():
    for name in ("ar", "", None):
        with pytest.raises(ValueError):
            register_drafter(name, Bigram)


def test_one_ops_namespace_reaches_the_model_the_matrix_and_the_loop(peaky):
    engine = Engine.from_pretrained(peaky, dtype="float64", ops="kernels,recycle_update_=reference")
    assert engine.model.ops is engine.ops is engine.matrix.ops is engine.drafter("tr").matrix.ops
    assert engine.ops is load_ops("kernels,recycle_update_=reference")  # built once per spec
    assert engine.ops.recycle_update_ is reference.recycle_update_
    assert all(is_compiled(engine.ops, n) for n in ("compact_kv_", "tree_attention", "skinny_linear"))

    # A namespace handed in is used as it is: every call of these ops, from the model, the matrix and the loop,
    # goes through it.
    calls, kernels = Counter(), load_ops("kernels")

    def counted(name):
        def op(*args):
            calls[name] += 1
            return getattr(kernels, name)(*args)
        return op

    spied = ("compact_kv_", "recycle_update_", "tree_attention")
    spy = SimpleNamespace(**{**vars(kernels), **{n: counted(n) for n in spied}, "kind": "spy"})
    engine = Engine.from_pretrained(peaky, dtype="float64", ops=spy, tree="2.2.2")
    g = engine.generate("hello hello", max_new_tokens=40, method="tr").generation
    assert calls["recycle_update_"] == g.steps  # one recycle per verify
    assert calls["compact_kv_"] == sum(a > 1 for a in g.accept_lengths) > 0  # one per step that accepted a draft
    assert calls["tree_attention"] >= g.steps * engine.model.config.num_hidden_layers


def test_ops_that_are_not_a_namespace_are_refused(peaky):
    with pytest.raises(InvalidType, match="lacks"):
        Engine.from_pretrained(peaky, ops=SimpleNamespace(kind="half", linear=None))
    with pytest.raises(InvalidValue, match="unknown ops"):
        Engine.from_pretrained(peaky, ops="kernelz")
