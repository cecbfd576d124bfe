"""A Llama decoder (Llama 1/2/3, Vicuna, SmolLM2) written out by hand, for one sequence at a time.

Module names equal the Hugging Face checkpoint keys, so loading is a strict `load_state_dict`. One forward serves
prefill, plain decoding and draft-tree verification: the caller passes the new tokens' positions, the cache slot where
they go, and whether they attend causally or through a tree mask.

The modules below are the readable model, and every forward on a GPU, under tensor parallelism and of a prompt runs
them. A packed CPU model's decode and verify steps run the same math as one op for all the layers
(ops.decoder_layers, csrc/cpu/decoder_layers.cpp): ~35 small PyTorch ops per layer cost as much as streaming the
weights there (bench/results/step_profile.md).

Under tensor parallelism (tr_engine/model/parallel.py) each rank builds the layers of its own slice (`local_config`: its
heads, its part of the FFN, its rows of the vocabulary), adds the partial outputs of o_proj and down_proj across ranks,
and gathers the logits, so the forward returns every rank the whole model's logits; or, with `gather=False`, its own
columns of them, which a greedy verify step reduces to the merged top-k (Llama.top_k) instead.

Glossary: T new tokens, P cached prefix tokens, S cache capacity, Hq/Hkv query/key-value heads, G = Hq // Hkv,
D head dim, E hidden size, F FFN size, V vocab, L layers.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tr_engine.model.config import LlamaConfig, rope_inv_freq
from tr_engine.model.functional import apply_rope, rms_norm
from tr_engine.model.ops import is_compiled, resolve_ops
from tr_engine.model.parallel import ALONE, Shard, local_config, stable_topk
from tr_engine.model.reference import rows_to_ragged


def fuse_linears_(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate the weights of bias-free linears that read the same input into one [sum(out), in] matrix (one
    matmul instead of several) and make each module's weight a view of it: the state_dict is unchanged and no memory
    is added."""
    w = torch.cat([m.weight.data for m in linears])  # [sum(out), in]
    for m, part in zip(linears, w.split([m.out_features for m in linears])):
        m.weight.data = part
    return w


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_table(config: LlamaConfig, max_positions: int, dtype: torch.dtype,
               device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for positions 0..max_positions-1, each [max_positions, D]: (cos, cos) and (-sin, sin).

    The angles are computed in float32 exactly as Hugging Face does, then cast to `dtype`.
    """
    inv_freq = rope_inv_freq(config).to(device)  # [D/2]
    angles = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()  # [S, D/2]
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


@dataclass(frozen=True)
class AttentionMask:
    """Who the T new tokens may attend to (True = may); each sees all P cached tokens. `tree` bool [T, T] among the
    new tokens, for the tree_attention op (a verify step, or a CPU decode step: a one-node tree); otherwise `folded`
    bool [G*T, P+T], the whole mask with rows in the folded (group, token) order, for PyTorch's fused attention (a
    prompt chunk), or `causal` (a CPU prompt chunk from slot 0: the fused kernel's own causal path, which skips the
    blocks above the diagonal that a mask would make it compute and then drop: a 2000-token prompt of SmolLM2's
    attends in about half the time; its sums are blocked otherwise, so a few prompts' logits round differently, every
    method's alike), or none: see everything (a GPU decode step). `slots` int64
    [T]: where the new tokens' K/V go, when the prefix length is a device tensor rather than an int (a step a CUDA
    graph replays: tr_engine/model/graphs.py)."""

    tree: torch.Tensor | None = None
    folded: torch.Tensor | None = None
    causal: bool = False
    slots: torch.Tensor | None = None
    batch: "RaggedBatch | RowBatch | None" = None  # a batched forward: each sequence's rows in its own cache slot


@dataclass(frozen=True)
class RaggedBatch:
    """Where the rows of a batched forward belong (tr_engine/core/batch.py): sequence b is rows
    offsets[b]..offsets[b+1],
    in cache slot slots[b] after prefix_lens[b] cached tokens, with its tree mask (T_b x T_b) flattened into
    tree_masks, bool [sum T_b^2]; seq and pos, int64 [T]: each row's slot and the cache position its K/V go to."""

    slots: list[int]
    prefix_lens: list[int]
    offsets: list[int]
    tree_masks: torch.Tensor
    seq: torch.Tensor | None  # (the module path's cache write; ops.decoder_layers derives them from the lists)
    pos: torch.Tensor | None


@dataclass(frozen=True)
class RowBatch:
    """A batched forward's rows with every place in a tensor of a fixed shape, so that nothing on the host depends on
    which sequences ride in it: the form a CUDA graph of a batched step replays (tr_engine/model/graphs.py,
    BatchGraphs). seq, pos int64 [T]: each row's slot and the cache position its K/V go to; rows int64 [T, 3] and
    tree_mask bool [T, T]: as the ops' tree_attention_rows takes them (each row's slot, its sequence's prefix length
    and first row; which rows each row sees)."""

    seq: torch.Tensor
    pos: torch.Tensor
    rows: torch.Tensor
    tree_mask: torch.Tensor

    def ragged(self) -> RaggedBatch:
        """The same rows as a RaggedBatch, read on the host (a CPU step: ops.decoder_layers takes lists)."""
        slots, prefix_lens, offsets, masks = rows_to_ragged(self.rows.tolist(), self.tree_mask)
        return RaggedBatch(slots, prefix_lens, offsets, masks, self.seq, self.pos)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, shard: Shard = ALONE):
        """`config`: this rank's slice of the model (all of it alone); o_proj's partial sums add across `shard`."""
        super().__init__()
        self.shard = shard
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        E, D = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(E, self.n_heads * D, bias=False)
        self.k_proj = nn.Linear(E, self.n_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(E, self.n_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.n_heads * D, E, bias=False)
        # The weights the forward multiplies by, set by fuse_() and replaced by pack_(): [(Hq + 2 Hkv) D, E], [E, Hq D].
        self.qkv_weight = self.o_weight = None

    def fuse_(self) -> None:
        self.qkv_weight = fuse_linears_(self.q_proj, self.k_proj, self.v_proj)
        self.o_weight = self.o_proj.weight.detach()  # a plain tensor (a Parameter would join the state_dict)

    def forward(self, x, cos, sin, kv, start, mask: "AttentionMask", ops):
        """x [T, E]; kv [2, Hkv, S, D] this layer's cache, new K/V written at slots start..start+T-1. `start` is an
        int, or a one-element int64 tensor on the device with the slots in `mask.slots` (a replayable step). A batched
        forward (mask.batch) has kv [N, 2, Hkv, S, D], every slot's cache of this layer."""
        T, D, Hq, Hkv = x.shape[0], self.head_dim, self.n_heads, self.n_kv_heads
        qkv = ops.linear(x, self.qkv_weight).view(T, Hq + 2 * Hkv, D)  # [T, Hq + 2 Hkv, D]: q heads, then k, then v
        qk = apply_rope(qkv[:, : Hq + Hkv], cos, sin)  # [T, Hq + Hkv, D], q and k rotated together
        k_new, v_new = qk[:, Hq:].transpose(0, 1), qkv[:, Hq + Hkv :].transpose(0, 1)  # [Hkv, T, D] each
        if mask.batch is not None:  # each row to its sequence's slot and position, then each sequence's attention
            b = mask.batch
            kv[b.seq, 0, :, b.pos] = qk[:, Hq:]
            kv[b.seq, 1, :, b.pos] = qkv[:, Hq + Hkv :]
            if isinstance(b, RowBatch):  # (a replayable step: the places are read on the device)
                o = ops.tree_attention_rows(qk[:, :Hq], kv[:, 0], kv[:, 1], b.rows, b.tree_mask, D**-0.5)
            else:
                o = ops.tree_attention_batch(qk[:, :Hq], kv[:, 0], kv[:, 1], b.slots, b.prefix_lens, b.offsets,
                                             b.tree_masks, D**-0.5)  # [T, Hq, D]
            return self.out(o.reshape(T, Hq * D), ops)
        if mask.slots is not None:  # the prefix length lives on the device: a step a CUDA graph replays anywhere
            kv[0].index_copy_(1, mask.slots, k_new)
            kv[1].index_copy_(1, mask.slots, v_new)
        else:
            kv[0, :, start : start + T] = k_new
            kv[1, :, start : start + T] = v_new
        if mask.tree is not None:  # a verify (or CPU decode) step: every cached token plus the tree ancestors
            attend = ops.tree_attention if mask.slots is None else ops.tree_attention_dynamic
            o = attend(qk[:, :Hq], kv[0], kv[1], start, mask.tree, D**-0.5)  # [T, Hq, D]
            return self.out(o.reshape(T, Hq * D), ops)
        end = start + T
        if mask.causal:  # [1, Hq, T, D] against [1, Hkv, T, D]: each KV head serves its G query heads
            o = F.scaled_dot_product_attention(qk[:, :Hq].transpose(0, 1)[None], kv[None, 0, :, :end],
                                               kv[None, 1, :, :end], is_causal=True, enable_gqa=True)
            return self.out(o[0].transpose(0, 1).reshape(T, Hq * D), ops)
        # Grouped-query attention without copying K/V: the G query heads that share a KV head are folded into the
        # row dimension, [T, Hq, D] -> [Hkv, G*T, D], so each KV head is read once, as plain multi-head attention.
        # 4-D inputs select PyTorch's fused CPU/GPU attention kernels (3-D ones fall back to the unfused math path).
        q = qk[:, :Hq].reshape(T, Hkv, Hq // Hkv, D).permute(1, 2, 0, 3).reshape(1, Hkv, -1, D)  # [1, Hkv, G*T, D]
        o = F.scaled_dot_product_attention(q, kv[None, 0, :, :end], kv[None, 1, :, :end], attn_mask=mask.folded)
        o = o.view(Hkv, Hq // Hkv, T, D).permute(2, 0, 1, 3).reshape(T, Hq * D)  # [T, Hq*D]
        return self.out(o, ops)

    def out(self, o: torch.Tensor, ops) -> torch.Tensor:
        """o_proj: [T, Hq*D] -> [T, E], summed over the ranks' heads."""
        return self.shard.all_reduce_(ops.linear(o, self.o_weight))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, shard: Shard = ALONE):
        super().__init__()
        self.shard = shard
        E, Fd = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(E, Fd, bias=False)
        self.up_proj = nn.Linear(E, Fd, bias=False)
        self.down_proj = nn.Linear(Fd, E, bias=False)
        self.gate_up_weight = self.down_weight = None  # [2F, E] and [E, F], as in Attention

    def fuse_(self) -> None:
        self.gate_up_weight = fuse_linears_(self.gate_proj, self.up_proj)
        self.down_weight = self.down_proj.weight.detach()

    def forward(self, x, linear):
        gate, up = linear(x, self.gate_up_weight).chunk(2, dim=-1)  # [T, F] each (this rank's part of F)
        return self.shard.all_reduce_(linear(F.silu(gate) * up, self.down_weight))  # [T, E], summed over the ranks


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, shard: Shard = ALONE):
        super().__init__()
        self.self_attn = Attention(config, shard)
        self.mlp = MLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv, start, mask, ops):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, start, mask, ops)
        return x + self.mlp(self.post_attention_layernorm(x), ops.linear)


class LlamaBody(nn.Module):
    def __init__(self, config: LlamaConfig, shard: Shard = ALONE, vocab_rows: int | None = None):
        super().__init__()
        # This rank's rows, left uninitialised: the weights are loaded over them. (A default Embedding draws normal
        # values, whose meta-device kernel imports torch._dynamo: a second on every start, for nothing.)
        rows = vocab_rows or config.vocab_size
        self.embed_tokens = nn.Embedding(rows, config.hidden_size, _weight=torch.empty(rows, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, shard) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama(nn.Module):
    """The causal LM. Build on the `meta` device and fill with `tr_engine.model.weights.load_model`.

    `ops` (tr_engine.model.ops.load_ops) supplies `linear(x [T, in], w [out, in] or a PackedWeight) -> [T, out]`, which
    computes every projection, and `tree_attention`, the attention of decode and verify steps: the compiled kernels
    or their pure-PyTorch references (the default here). The decode loop and the recycling matrix take the same
    namespace.
    """

    def __init__(self, config: LlamaConfig, ops=None, shard: Shard = ALONE):
        super().__init__()
        self.config = config  # the whole model's
        self.shard, self.local_config = shard, local_config(config, shard)  # this rank's slice (a KV cache's heads)
        self.vocab = shard.split(config.vocab_size)  # the token ids whose embedding and logits this rank holds
        self.ops = resolve_ops(ops or "reference")
        rows = self.vocab[1] - self.vocab[0]
        self.model = LlamaBody(self.local_config, shard, rows)
        self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        self.head_weight = None  # [V, E], the LM head as the forward uses it (fuse_, pack_)
        self.rope_cos: torch.Tensor | None = None  # [S, D], from set_max_positions()
        self.rope_sin: torch.Tensor | None = None
        self.fused_layers = False  # the layers as one op (pack_); a benchmark may turn it off to compare
        self.fused_weights: list[torch.Tensor] = []  # its weights, six a layer, then the final norm's
        self.fused_dims: tuple = ()  # (n_heads, ffn, eps)
        # A CPU decode step's mask, a one-node tree (and flattened, as a batch of one): made once. After a step has
        # streamed the weights through the caches, each small PyTorch op costs tens of microseconds.
        self.one_node = torch.ones(1, 1, dtype=torch.bool, device="cpu")  # (a model is built on the meta device)
        self.one_node_flat = self.one_node.view(-1)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def chunks_exact(self) -> bool:
        """Whether a prompt prefilled in chunks caches the same K/V and gives the same logits as prefilled whole: on a
        CPU with the compiled attention op, which attends each prompt row as the decode step at its position would
        (forward's comment on prompt chunks); PyTorch's fused attention makes no such promise."""
        return self.device.type == "cpu" and is_compiled(self.ops, "tree_attention")

    def set_max_positions(self, n: int) -> None:
        """Precompute the rotary table for positions 0..n-1 (the cache capacity), in the model's dtype and device."""
        self.rope_cos, self.rope_sin = rope_table(self.config, n, self.dtype, self.device)

    def fuse_(self) -> None:
        """Fuse the q/k/v and the gate/up projections into single matmuls (weights shared, state_dict unchanged)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_()
            layer.mlp.fuse_()
        self.head_weight = self.lm_head.weight.detach()

    def pack_(self, pack) -> None:
        """Give every projection to the forward in the layout of the CPU matmul kernel (`pack`: tr_engine.model.ops'
        `pack`, w -> PackedWeight) and drop the plain copies, so the weights' memory is not doubled. Afterwards the
        projection modules hold no weight: state_dict() lists the embeddings and norms only."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_weight, attn.o_weight = pack(attn.qkv_weight), pack(attn.o_weight)
            mlp.gate_up_weight, mlp.down_weight = pack(mlp.gate_up_weight), pack(mlp.down_weight)
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                m.weight = None
        self.head_weight = pack(self.head_weight)  # a tied head: a packed copy; the embedding stays for the lookup
        self.lm_head.weight = None
        if self.shard.world == 1:  # (tensor parallelism adds partial sums mid-layer: the module path)
            self.fused_weights = []  # ops.decoder_layers' list: six a layer, views of the module's weights
            for layer in self.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                self.fused_weights += [layer.input_layernorm.weight.detach(), attn.qkv_weight.data, attn.o_weight.data,
                                       layer.post_attention_layernorm.weight.detach(), mlp.gate_up_weight.data,
                                       mlp.down_weight.data]
            # then the final norm's: the op returns normed rows (as eight PyTorch ops after it, the norm cost ~0.3 ms
            # of a SmolLM2 step, its dispatches running with the caches full of the weights just streamed)
            self.fused_weights.append(self.model.norm.weight.detach())
            first = self.model.layers[0]
            self.fused_dims = (first.self_attn.n_heads, first.mlp.gate_up_weight.n // 2, first.input_layernorm.eps)
        self.fused_layers = self.shard.world == 1

    def fused_rows(self, T: int, start, mask: AttentionMask) -> RaggedBatch | None:
        """The rows of a forward that may run through ops.decoder_layers, as a ragged batch, or None: a packed CPU
        model's decode and verify steps (a tree mask, or a batch) and its prompt chunks (a causal tree mask)."""
        if not self.fused_layers:
            return None
        if mask.batch is not None:
            return mask.batch.ragged() if isinstance(mask.batch, RowBatch) else mask.batch
        if mask.tree is None:
            return None
        # (A prefix length in a tensor is a step that tr_engine/model/graphs.py replays; on a CPU, where packed models
        # live,
        # it is read here as tree_attention_dynamic's CPU kernel reads it: its slots are start..start+T-1 all the same.)
        prefix = int(start) if isinstance(start, torch.Tensor) else start
        flat = self.one_node_flat if mask.tree is self.one_node else mask.tree.reshape(-1)
        return RaggedBatch(slots=[0], prefix_lens=[prefix], offsets=[0, T], tree_masks=flat, seq=None, pos=None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        start: int | torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        last_logits_only: bool = False,
        batch: RaggedBatch | RowBatch | None = None,
        gather: bool = True,
    ) -> torch.Tensor:
        """Run T new tokens against the P = `start` tokens already in the cache and return their logits.

        input_ids [T] int64; positions [T] int64 (P..P+T-1 for causal input, P + depth for a tree);
        kv_cache [L, 2, Hkv, S, D], updated in place: the new tokens' K/V go to slots start..start+T-1;
        tree_mask None for causal attention among the new tokens, else bool [T, T], True where token i may attend
        to token j (a tree token sees its ancestors and itself). Every new token sees all P cached tokens. A tree (and
        on a CPU a single decode token, or a packed model's prompt chunk) goes through the ops' tree_attention; a
        causal chunk of a prompt otherwise (and a GPU decode token) through PyTorch's fused attention.
        `start` may also be a one-element int64 tensor on the model's device (with a tree_mask; T = 1 takes [[True]]):
        then nothing in the forward depends on the prefix length on the host, and a CUDA graph of it replays at every
        prefix (tr_engine/model/graphs.py). The caller keeps start + T within the cache.
        With `batch` (a RaggedBatch), the rows are several sequences' in one forward: kv_cache is a BatchKVCache's
        [N, L, 2, Hkv, S, D], each sequence's rows attend to their own slot (tree_attention_batch), `start` is unused;
        a RowBatch is the same with every place in a tensor (a replayable batched step, tree_attention_rows).
        Returns logits [T, V] in float32 (float64 for a float64 model), or [1, V] for the last token when
        `last_logits_only`; under tensor parallelism with `gather=False`, this rank's columns [T, V_r] of them (ids
        self.vocab[0]..).
        """
        T = input_ids.shape[0]
        G = self.config.num_attention_heads // self.config.num_key_value_heads  # (a rank's slice has the same G)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [T, D] each
        device = input_ids.device
        if batch is not None:
            mask, kv_cache = AttentionMask(batch=batch), kv_cache.transpose(0, 1)  # layer-major: [L, N, 2, ...]
        elif isinstance(start, torch.Tensor):
            if tree_mask is None:
                raise ValueError("a forward whose start is a tensor takes a tree_mask ([[True]] for one token)")
            mask = AttentionMask(tree=tree_mask, slots=start + torch.arange(T, device=device))
        elif tree_mask is not None:
            mask = AttentionMask(tree=tree_mask)
        elif T == 1 and device.type == "cpu":
            # A CPU decode step is a one-node tree: the op beats PyTorch's fused attention for one query at the
            # prefixes a chat reaches (bench/results/kernels_cpu.md).
            mask = AttentionMask(tree=self.one_node)
        elif T == 1:
            mask = AttentionMask()  # a GPU decode step: PyTorch's fused attention, nothing to mask
        elif device.type == "cpu" and is_compiled(self.ops, "tree_attention"):
            # A prompt chunk on a CPU with the compiled kernels: a causal "tree" through the attention op of the
            # decode steps (and for a packed model through its one op for the layers), each row the bits of the
            # decode step at its position (the kernel attends a causal chunk as a growing prefix). A prompt
            # prefilled whole, in chunks, or after a cached prefix (the next turn, a slot's reused prefix) then
            # caches the same K/V and gives the same logits: what makes prefix reuse exact.
            mask = AttentionMask(tree=torch.ones(T, T, dtype=torch.bool).tril())
        elif start == 0 and device.type == "cpu":
            mask = AttentionMask(causal=True)
        else:
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            seen = torch.ones(T, start, dtype=torch.bool, device=device)
            mask = AttentionMask(folded=torch.cat([seen, causal], dim=1).repeat(G, 1))  # [G*T, P+T]
        x = self.embed(input_ids)  # [T, E]
        rows = self.fused_rows(T, start, mask)
        if rows is None:
            for layer, kv in zip(self.model.layers, kv_cache):
                x = layer(x, cos, sin, kv, start, mask, self.ops)
            x = self.model.norm(x[-1:] if last_logits_only else x)
        else:  # every layer and the final norm in one op (the cache as a batch of one slot when it is one sequence's)
            kv = kv_cache if batch is not None else kv_cache[:, None]  # [L, N, 2, Hkv, S, D]
            x = self.ops.decoder_layers(x, self.fused_weights, cos, sin, kv, rows.slots, rows.prefix_lens,
                                        rows.offsets, rows.tree_masks, *self.fused_dims)
            x = x[-1:] if last_logits_only else x
        logits = self.ops.linear(x, self.head_weight)  # [T, V] (this rank's V alone)
        if gather:
            logits = self.shard.gather_last(logits, self.config.vocab_size)  # [T, V]
        return logits if logits.element_size() >= 4 else logits.float()

    def top_k(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stable top-k of the whole vocabulary (values [T, k], ids [T, k]: ties by the lower id) from this rank's
        columns of the logits (a forward with gather=False): what a greedy step needs of a row, merged across the ranks
        in one small collective (Shard.topk) instead of gathering every rank's columns."""
        return self.shard.topk(logits, k, self.vocab[0], self._local_top_k)

    def _local_top_k(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """parallel.stable_topk's answer, from the compiled top_k_rows on a CPU (one pass a row: 0.05 ms for 16 rows
        of a 2-rank shard of SmolLM2's logits against 0.8 ms in PyTorch ops; its reference twin is a whole sort)."""
        if logits.device.type != "cpu" or not is_compiled(self.ops, "top_k_rows"):
            return stable_topk(logits, k)
        ids = self.ops.top_k_rows(logits, k)
        return logits.gather(1, ids), ids

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings [T, E] of input_ids [T]; under tensor parallelism each rank looks up the ids in its rows,
        zeros for the others, and the ranks' lookups are added (exactly: all but one are zero)."""
        if self.shard.world == 1:
            return self.model.embed_tokens(input_ids)
        start, stop = self.vocab
        local = input_ids - start
        mine = (local >= 0) & (local < stop - start)  # [T]
        x = self.model.embed_tokens(local.clamp(0, stop - start - 1))  # [T, E]
        return self.shard.all_reduce_(torch.where(mine[:, None], x, torch.zeros((), dtype=x.dtype)))
