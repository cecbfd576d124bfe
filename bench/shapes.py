"""Model shapes the benchmarks measure with random weights, where no real checkpoint can be had (a bare GPU machine
has none, and nothing may be downloaded): SmolLM2-135M, the embedded default, Vicuna-7B, the paper's main model, and
Llama-3-8B (grouped-query heads and a 128K vocabulary).
`tiny` and `tiny-mha` are the CPU rehearsal's stand-ins, small enough that every stage of bench.gpu_check runs in
seconds."""

from tr_engine.model.config import LlamaConfig

SHAPES = {
    "smollm2": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                           rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "vicuna-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                             max_position_embeddings=2048),
    "llama-3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              max_position_embeddings=8192, rope_theta=500000.0),
    # The rehearsal's stand-ins: grouped-query heads like SmolLM2's, and one KV head per query head like Vicuna's.
    "tiny": LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
    "tiny-mha": LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=4096),
}
STAND_INS = {"smollm2": "tiny", "vicuna-7b": "tiny-mha"}  # what the CPU rehearsal runs in place of each


def projections(config: LlamaConfig) -> list[tuple[int, int]]:
    """One forward's weight matrices as the model multiplies by them ([out, in]; q/k/v and gate/up fused), the LM
    head last."""
    E, D, F = config.hidden_size, config.head_dim, config.intermediate_size
    Hq, Hkv = config.num_attention_heads, config.num_key_value_heads
    layer = [((Hq + 2 * Hkv) * D, E), (E, Hq * D), (2 * F, E), (E, F)]
    return layer * config.num_hidden_layers + [(config.vocab_size, E)]


def weight_bytes(config: LlamaConfig, element_size: int) -> int:
    """Bytes of weights one decode step reads: every projection and the LM head (norms are negligible; the embedding
    lookup reads one row)."""
    return element_size * sum(n * k for n, k in projections(config))


def kv_bytes(config: LlamaConfig, element_size: int, prefix: int) -> int:
    """Bytes of cached K and V one decode step reads after `prefix` tokens."""
    return element_size * 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * prefix


def held_tensors(model) -> list:
    """Every distinct tensor a built model holds for its weights (packed copies included; a tied head once)."""
    seen = {}
    for t in list(model.state_dict().values()) + [w for layer in model.model.layers for w in (
            layer.self_attn.qkv_weight, layer.self_attn.o_weight, layer.mlp.gate_up_weight, layer.mlp.down_weight)] \
            + [model.head_weight]:
        x = getattr(t, "data", t)  # a PackedWeight's packed tensor
        seen[x.data_ptr()] = x
    return list(seen.values())


def held_bytes(model) -> int:
    """The bytes of held_tensors: what a model's weights occupy in memory."""
    return sum(t.numel() * t.element_size() for t in held_tensors(model))
