"""Tensor parallelism: one model across N processes (ranks), each holding a slice of every layer.

    torchrun --nproc-per-node 2 -m tr_engine.generate --tp 2 --model vicuna-13b --prompt "..."

The split is Megatron's, as gpt-fast and nano-vllm do it: q/k/v and gate/up are split by output (each rank computes
its own heads and its own part of the FFN, with no communication), o and down by input (each rank's partial sums
are added across ranks: one all-reduce after attention and one after the MLP), and the embedding and the LM head by
vocabulary (a lookup all-reduced; each rank's logits for its own tokens). KV heads go to ranks whole, each with the
query heads that share it, so a model whose KV heads do not divide by N (SmolLM2: 3) splits them unevenly.

Every rank runs the same decode loop on the same numbers, rather than rank 0 deciding and broadcasting: the logits
every rank sees are bit for bit the same (each rank's share gathered in rank order), and so are the merged top-k a
greedy verify step takes instead of them (Shard.topk), so every rank drafts, accepts and recycles exactly alike and
holds the same matrix, and nothing but activations and those top-k crosses between ranks. Drafting costs each rank
a millisecond or so; a broadcast of rank 0's draft would cost every step one more round trip, in which the other
ranks idle.

Glossary: N ranks (world), r this rank, V vocab; split(n) gives rank r its contiguous share of n items, the first
n % N ranks one more.
"""

import os
import re
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta

import torch

from tr_engine.errors import UnsupportedConfig, UserError
from tr_engine.model.config import LlamaConfig

DEFAULT_TIMEOUT_S = 120.0  # a rank that does not answer a collective within this ends the run (not a hang)
TIMEOUT_ENV = "TR_ENGINE_TP_TIMEOUT_S"


class RankLost(UserError):
    """Another rank of the run stopped (or stopped answering): this one cannot go on alone. A command ends at once
    on it (tr_engine/cli/common.py), without the backend's teardown, which can abort on a broken connection."""

    abandon_process = True


@dataclass(frozen=True)
class Shard:
    """This process's place in the model: rank `rank` of `world` (collectives over the default process group)."""

    rank: int = 0
    world: int = 1

    def split(self, n: int, rank: int | None = None) -> tuple[int, int]:
        """Rank `rank`'s (default: this rank's) contiguous share [start, stop) of n items."""
        r = self.rank if rank is None else rank
        base, extra = divmod(n, self.world)
        start = r * base + min(r, extra)
        return start, start + base + (r < extra)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (a no-op alone)."""
        if self.world > 1:
            with lost_rank():
                torch.distributed.all_reduce(x)
        return x

    def gather_last(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """Every rank's share of the last dimension (split(n) of it), concatenated in rank order: [..., n]."""
        if self.world == 1:
            return x
        widest = self.split(n, 0)[1]
        padded = torch.nn.functional.pad(x, (0, widest - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        with lost_rank():
            torch.distributed.all_gather(parts, padded)
        return torch.cat([p[..., : b - a] for p, (a, b) in zip(parts, (self.split(n, r) for r in
                                                                         range(self.world)))], dim=-1)


    def topk(self, logits: torch.Tensor, k: int, start: int,
             local: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k over the whole vocabulary from each rank's shard of the logits ([T, V_r], this rank's ids
        start..start+V_r-1): each rank's stable top-k (`local`, stable_topk's answer: ties by the lower id; default
        stable_topk), all-gathered in one collective, and the k best of those, stably again. The ranks' candidates
        arrive in rank order, which is id order, so a tie still goes to the lower id: the same ids, in the same order,
        as a stable top-k of the whole row. Returns (values [T, k], ids [T, k] int64), the same on every rank: what
        greedy acceptance (the first column) and the recycling matrix need of a row, at 2k numbers a rank instead of
        V_r."""
        values, ids = (local or stable_topk)(logits, k)
        ids = ids + start
        if self.world == 1:
            return values, ids
        # one message: values and ids side by side in float64 (exact for any float logits and any id below 2^53)
        mine = torch.cat([values.double(), ids.double()], dim=1)  # [T, 2k]
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        with lost_rank():
            torch.distributed.all_gather(everyone, mine)
        values = torch.cat([m[:, :k] for m in everyone], dim=1).to(logits.dtype)  # [T, N*k], rank (= id) order
        ids = torch.cat([m[:, k:] for m in everyone], dim=1).long()
        best = values.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        return values.gather(1, best), ids.gather(1, best)

    def agree(self, seconds: float) -> float:
        """The largest of the ranks' values (a step's time), the same on every rank: what a decision that every rank
        must make alike (the adaptive tree's) may depend on."""
        if self.world == 1:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64)
        with lost_rank():
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t)

    def generator(self, seed: int | None) -> torch.Generator:
        """A random stream seeded by `seed`, or else freshly, alike on every rank (rank 0's seed)."""
        rng = torch.Generator()
        if seed is not None:
            return rng.manual_seed(seed)
        rng.seed()
        return rng.manual_seed(self.from_rank0(rng.initial_seed())) if self.world > 1 else rng

    def from_rank0(self, obj):
        """Rank 0's `obj` (any picklable value), on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        with lost_rank():
            torch.distributed.broadcast_object_list(box, src=0)
        return box[0]


ALONE = Shard()


def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of x [T, V] and their ids, best first, ties by the lower id: exactly the first k
    columns of x.sort(dim=-1, descending=True, stable=True), at the cost of torch.topk (a full stable sort of a
    row is ~50x slower). torch.topk picks among values tied at the k-th place as it likes, so a row where more than
    k values reach the k-th takes the lowest ids among the tied ones; then the k are ordered by value, stably over
    ascending ids."""
    values, ids = x.topk(k, dim=-1)
    kth = values[:, -1:]  # [T, 1]
    tied = ((x >= kth).sum(dim=-1) > k).nonzero()[:, 0]  # rows with more candidates than places
    if len(tied):
        y, kth_y = x[tied], kth[tied]
        above, at = y > kth_y, y == kth_y
        places = k - above.sum(dim=-1, keepdim=True)  # left for the tied values, given to the lowest ids
        chosen = above | (at & (at.cumsum(dim=-1) <= places))  # exactly k a row
        ids[tied] = chosen.nonzero()[:, 1].view(len(tied), k)
    ids = ids.sort(dim=-1).values
    values = x.gather(1, ids)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    return values.gather(1, order), ids.gather(1, order)


def local_config(config: LlamaConfig, shard: Shard) -> LlamaConfig:
    """The config of this rank's slice: its KV heads (whole, with their query heads) and its part of the FFN; the
    vocabulary stays the model's (the tokenizer, the matrix and the logits the loop sees are the whole model's)."""
    if shard.world == 1:
        return config
    Hkv, G = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    if Hkv < shard.world:
        raise UnsupportedConfig(f"--tp {shard.world} needs at least {shard.world} key-value heads, and the model has "
                                f"{Hkv}; use --tp {Hkv} or fewer")
    if config.intermediate_size < shard.world:
        raise UnsupportedConfig(f"--tp {shard.world} is more ranks than the FFN has units; use a smaller --tp")
    a, b = shard.split(Hkv)
    f0, f1 = shard.split(config.intermediate_size)
    return replace(config, num_key_value_heads=b - a, num_attention_heads=(b - a) * G, intermediate_size=f1 - f0)


def slices(config: LlamaConfig, shard: Shard) -> dict[str, tuple[int, int, int]]:
    """What this rank reads of each sharded weight: key suffix -> (dimension, start, stop) in the stored tensor."""
    D, G = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    a, b = shard.split(config.num_key_value_heads)
    f0, f1 = shard.split(config.intermediate_size)
    v0, v1 = shard.split(config.vocab_size)
    return {"self_attn.q_proj.weight": (0, a * G * D, b * G * D), "self_attn.k_proj.weight": (0, a * D, b * D),
            "self_attn.v_proj.weight": (0, a * D, b * D), "self_attn.o_proj.weight": (1, a * G * D, b * G * D),
            "mlp.gate_proj.weight": (0, f0, f1), "mlp.up_proj.weight": (0, f0, f1), "mlp.down_proj.weight": (1, f0, f1),
            "embed_tokens.weight": (0, v0, v1), "lm_head.weight": (0, v0, v1)}


@contextmanager
def lost_rank():
    """A collective that failed because another rank is gone (killed, crashed, or silent past the timeout) becomes
    one line, RankLost, instead of a backend's traceback."""
    try:
        yield
    except RuntimeError as e:  # gloo and NCCL raise torch.distributed.DistBackendError, a RuntimeError
        first = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or ["no message"])[0])[:160]
        raise RankLost(f"another rank of this --tp run stopped or did not answer within {timeout_s():g}s ({first}); "
                       "this rank stops too: see the other ranks' output for why")


def timeout_s() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        raise UserError(f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r} is not a number of seconds")


def heartbeat_s() -> float:
    """How often rank 0, waiting for work (a client, a line of input), tells the other ranks, who wait for it in a
    collective, that it is still there: well within the timeout."""
    return min(10.0, timeout_s() / 4)


def init(tp: int, device: torch.device) -> Shard:
    """Join the run's process group (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): gloo on a
    CPU, NCCL on CUDA (each rank on its LOCAL_RANK's GPU), every collective bounded by $TR_ENGINE_TP_TIMEOUT_S
    (default 120 s)."""
    if tp == 1:
        return ALONE
    world = os.environ.get("WORLD_SIZE")
    if world is None or "RANK" not in os.environ:
        raise UserError(f"--tp {tp} runs one process per rank: launch with torchrun --nproc-per-node {tp} -m "
                        "tr_engine.<command> --tp {tp} ...".replace("{tp}", str(tp)))
    if int(world) != tp:
        raise UserError(f"--tp {tp} but torchrun started {world} processes; pass --nproc-per-node {tp}")
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        with lost_rank():
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s()))
    return Shard(dist.get_rank(), dist.get_world_size())


def joined() -> bool:
    """Whether this process is a rank of a --tp run."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def leave() -> None:
    """The end of a rank's run: wait until every rank is done, then go (tr_engine/cli/common.py then exits at once). The
    process group is not taken down: gloo's teardown, racing a peer that already closed its connections, aborted a
    finished rank now and then."""
    try:
        torch.distributed.barrier()
    except RuntimeError:  # the others are gone already: nothing to wait for
        pass
