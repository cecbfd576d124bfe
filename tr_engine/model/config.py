"""Model hyperparameters, read from a Hugging Face `config.json` (Llama 1/2/3, Vicuna, SmolLM2 families).

Field names are Hugging Face's. Anything this engine does not implement is refused here, loudly, rather than
silently computing something else.
"""

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from tr_engine.errors import UnsupportedConfig, UserError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only: wavelengths between the two bounds are interpolated smoothly.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "LlamaConfig":
        def refuse(what: str) -> UnsupportedConfig:
            return UnsupportedConfig(f"{source}: {what}; tr_engine runs Llama-architecture models only")

        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "mistral") or (model_type == "mistral" and d.get("sliding_window")):
            raise refuse(f"model_type {model_type!r} is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise refuse(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise refuse("attention_bias / mlp_bias = true is not supported")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            kv_heads = int(d.get("num_key_value_heads") or heads)
            head_dim = int(d.get("head_dim") or hidden // heads)
            eos = d.get("eos_token_id", 2)
            config = cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(d, source),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            )
        except KeyError as e:
            raise UserError(f"{source}: required field {e.args[0]!r} is missing; is this a Hugging Face config.json?")
        except (TypeError, ValueError) as e:
            raise UserError(f"{source}: a field has the wrong type ({e}); fix or regenerate the file")
        if heads % kv_heads:
            raise refuse(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        return config

    @classmethod
    def from_json(cls, path: str | Path) -> "LlamaConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"no config.json at {path}; point --model at a Hugging Face model folder")
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON ({e}); re-download or regenerate it")
        return cls.from_dict(d, source=str(path))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _rope_scaling(d: dict, source: str) -> RopeScaling:
    # transformers >= 5 writes "rope_parameters"; older configs write "rope_scaling" (type or rope_type).
    rs = d.get("rope_scaling") or d.get("rope_parameters") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedConfig(
            f"{source}: rope scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if kind == "default":
        return RopeScaling()
    try:
        if kind == "linear":
            return RopeScaling("linear", float(rs["factor"]))
        return RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs["low_freq_factor"]),
            float(rs["high_freq_factor"]),
            int(rs["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise UnsupportedConfig(f"{source}: rope_scaling {kind!r} lacks field {e.args[0]!r}; add it to config.json")


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """The D/2 rotary frequencies, in float32 exactly as the checkpoints were trained with (Hugging Face's formulas)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [D/2]
    rs = config.rope_scaling
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    if rs.rope_type == "llama3":
        old_len = rs.original_max_position_embeddings
        low_freq_wavelen = old_len / rs.low_freq_factor
        high_freq_wavelen = old_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the ones between blended smoothly.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    return inv_freq
