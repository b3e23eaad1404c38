"""One frozen config for Gemma 1, 2 and 3 text models, built from a checkpoint's config.json.

The three generations differ only in the fields below (norm layout, soft-caps, QK-norm, sliding
window, rope thetas, per-layer attention types); the model reads these fields and never guesses
from names. Field names follow Hugging Face's config.json.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma3")

# Activations that mean "tanh-approximated GELU" for Gemma. Google's reference implementation
# uses the tanh approximation for every generation; early Gemma 1 configs said plain "gelu".
_TANH_GELU_NAMES = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")


class AttentionType(enum.Enum):
    GLOBAL = "full_attention"
    SLIDING = "sliding_attention"


@dataclass(frozen=True)
class RopeConfig:
    theta: float  # base of the inverse frequencies
    scaling_factor: float = 1.0  # linear position interpolation: positions are divided by this


@dataclass(frozen=True)
class GemmaConfig:
    model_type: str  # "gemma", "gemma2" or "gemma3_text"
    vocab_size: int
    hidden_size: int  # model width; embeddings are scaled by sqrt(hidden_size)
    intermediate_size: int  # GeGLU width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # 1 = MQA, < heads = GQA, == heads = MHA
    head_dim: int  # independent of hidden_size (Gemma-7B: 16 x 256 != 3072)
    rms_norm_eps: float
    max_position_embeddings: int
    query_pre_attn_scalar: float  # attention scores are scaled by query_pre_attn_scalar ** -0.5
    layer_types: tuple[AttentionType, ...]  # one per layer, computed once here
    rope_global: RopeConfig  # rope of full-attention layers
    rope_local: RopeConfig  # rope of sliding-window layers (Gemma 3 uses a smaller theta)
    sliding_window: int | None = None  # keys a sliding layer sees, the query's own included
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(scores / cap), pre-mask
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the output logits
    sandwich_norms: bool = False  # Gemma 2/3: extra norms after attention and around the MLP
    qk_norm: bool = False  # Gemma 3: RMSNorm on queries and keys, per head
    tie_word_embeddings: bool = True
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; "
                f"gemma-engine runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config.json: {name} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise CheckpointError(
                f"config.json: layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        if AttentionType.SLIDING in self.layer_types and not self.sliding_window:
            raise CheckpointError("config.json: sliding layers need a positive sliding_window")

    @property
    def has_sliding_layers(self) -> bool:
        return AttentionType.SLIDING in self.layer_types

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GemmaConfig:
        """Map a Hugging Face config.json dict onto this dataclass, explicitly."""
        model_type = cfg.get("model_type")
        if model_type == "gemma3":  # multimodal wrapper: the text model lives in text_config
            cfg = {"model_type": "gemma3_text", **cfg.get("text_config", {})}
            model_type = "gemma3_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; "
                f"gemma-engine runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise CheckpointError(f"config.json has no {key!r}, which a {model_type} needs")
            return cfg[key]

        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _TANH_GELU_NAMES:
            raise UnsupportedModelError(f"config.json: activation {act!r} is not Gemma's GELU")
        layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        gen2plus = model_type != "gemma"
        rope_global, rope_local = _rope_configs(cfg, model_type)
        eos = cfg.get("eos_token_id", 1)
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
            layer_types=_layer_types(cfg, model_type, layers),
            rope_global=rope_global,
            rope_local=rope_local,
            sliding_window=cfg.get("sliding_window") if gen2plus else None,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            sandwich_norms=gen2plus,
            qk_norm=model_type == "gemma3_text",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            bos_token_id=int(cfg.get("bos_token_id", 2)),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
            pad_token_id=int(cfg.get("pad_token_id") or 0),
            extra=dict(cfg),
        )


def _layer_types(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[AttentionType, ...]:
    if cfg.get("layer_types"):
        try:
            return tuple(AttentionType(t) for t in cfg["layer_types"])
        except ValueError as err:
            raise CheckpointError(f"config.json: bad layer_types entry: {err}") from None
    if model_type == "gemma":
        return (AttentionType.GLOBAL,) * layers
    if model_type == "gemma2":  # even layers slide, odd layers are global
        return tuple(
            AttentionType.SLIDING if i % 2 == 0 else AttentionType.GLOBAL for i in range(layers)
        )
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    return tuple(
        AttentionType.GLOBAL if (i + 1) % pattern == 0 else AttentionType.SLIDING
        for i in range(layers)
    )


def _rope_configs(cfg: dict[str, Any], model_type: str) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) rope settings from either the transformers-5 or the older keys."""

    def parse(params: dict[str, Any] | None, theta: float) -> RopeConfig:
        params = params or {}
        kind = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", theta))
        if kind == "default":
            return RopeConfig(theta)
        if kind == "linear":
            return RopeConfig(theta, float(params["factor"]))
        raise UnsupportedModelError(f"config.json: rope type {kind!r} is not supported")

    params = cfg.get("rope_parameters")
    if params and "full_attention" in params:  # transformers 5, one entry per attention type
        rope_global = parse(params["full_attention"], 10_000.0)
        rope_local = parse(params.get("sliding_attention"), 10_000.0)
        return rope_global, rope_local
    theta = float(cfg.get("rope_theta", 10_000.0))
    rope_global = parse(params or cfg.get("rope_scaling"), theta)
    if model_type == "gemma3_text":
        rope_local = RopeConfig(float(cfg.get("rope_local_base_freq", 10_000.0)))
    else:
        rope_local = rope_global
    return rope_global, rope_local
