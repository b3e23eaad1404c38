"""One frozen config for Gemma 1, 2, 3, 3n and 4 text models, built from a checkpoint's config.json.

The generations differ only in the fields below (norm layout, soft-caps, QK- and V-norm, sliding
window, rope per layer type, per-layer attention geometry, KV sharing, per-layer embeddings,
mixture of experts, AltUp, LAuReL); the model reads these fields and never guesses from names.
Everything that varies by layer is computed once here, in ``layers``. Field names follow Hugging
Face's config.json.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .config_checks import check_hf_config
from .errors import CheckpointError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma3n_text", "gemma4_text")
# Multimodal wrappers: the text model lives in their text_config.
_WRAPPERS = {"gemma3": "gemma3_text", "gemma3n": "gemma3n_text", "gemma4": "gemma4_text"}
_ACCEPTED = "gemma, gemma2, gemma3_text, gemma3, gemma3n_text, gemma3n, gemma4_text, gemma4"

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
    # Gemma 4's "proportional" RoPE on full layers: only this fraction of the frequency pairs
    # rotates (the rest get frequency 0, a pass-through); exponents still divide by head_dim.
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer's geometry is, when it differs between layers (Gemma 3n/4)."""

    head_dim: int  # Gemma 4's full layers use global_head_dim (512) next to 256
    num_key_value_heads: int
    intermediate_size: int  # GeGLU width: per layer in 3n; doubled on Gemma 4's shared layers
    # The layer whose keys and values this one attends to: itself, or for the last
    # num_kv_shared_layers (3n/4) the last earlier layer of the same type, in the same step.
    kv_source: int
    k_eq_v: bool = False  # Gemma 4 attention_k_eq_v (full layers): no v_proj, values = raw keys
    activation_sparsity: float = 0.0  # Gemma 3n: keep the gate's top (1 - this) by a gaussian fit


@dataclass(frozen=True)
class GemmaConfig:
    model_type: str  # one of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int  # model width; embeddings are scaled by sqrt(hidden_size)
    intermediate_size: int  # GeGLU width (the widest layer's; ``layers`` has each layer's)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # 1 = MQA, < heads = GQA, == heads = MHA
    # Independent of hidden_size (Gemma-7B: 16 x 256 != 3072); Gemma 4's full layers have their
    # own (see layers).
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5. Gemma 3n/4 do not scale them
    # (q_norm and k_norm set the scale), which is 1.0 here, whatever their config.json says.
    query_pre_attn_scalar: float
    layer_types: tuple[AttentionType, ...]  # one per layer, computed once here
    rope_global: RopeConfig  # rope of full-attention layers
    rope_local: RopeConfig  # rope of sliding-window layers (Gemma 3 uses a smaller theta)
    sliding_window: int | None = None  # keys a sliding layer sees, the query's own included
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(scores / cap), pre-mask
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the output logits
    sandwich_norms: bool = False  # Gemma 2+: extra norms after attention and around the MLP
    qk_norm: bool = False  # Gemma 3+: RMSNorm on queries and keys, per head
    # RMSNorm multiplies by (norm_offset + weight): Gemma 1-3 store w - 1 (offset 1), Gemma 3n/4
    # store w itself (offset 0).
    norm_offset: float = 1.0
    v_norm: bool = False  # Gemma 3n/4: a weightless RMSNorm on values, per head
    layer_scalar: bool = False  # Gemma 4: each layer's output times a stored scalar
    # Per layer, computed by from_hf; left empty, every layer gets the fields above.
    layers: tuple[LayerSpec, ...] = ()
    # Per-layer embeddings (Gemma 3n/4, "PLE"): each layer adds a gated term from a token's own
    # hidden_size_per_layer_input-wide embedding row; 0 = none.
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0  # rows of that table; ids beyond it read row 0 (3n)
    # Mixture of experts beside the dense MLP on every layer (Gemma 4 26B-A4B); 0 = none.
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    # AltUp (Gemma 3n): the hidden state is altup_num_inputs streams; layers run on one. 0 = none.
    altup_num_inputs: int = 0
    altup_active_idx: int = 0
    altup_correct_scale: bool = False
    laurel_rank: int = 0  # LAuReL (Gemma 3n): a low-rank residual beside attention; 0 = none
    tie_word_embeddings: bool = True
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; gemma-engine runs {_ACCEPTED}"
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
        if not self.layers:
            uniform = [
                LayerSpec(self.head_dim, self.num_key_value_heads, self.intermediate_size, i)
                for i in range(self.num_hidden_layers)
            ]
            object.__setattr__(self, "layers", tuple(uniform))
        self._check_layers()

    def _check_layers(self) -> None:
        if len(self.layers) != self.num_hidden_layers:
            raise CheckpointError(
                f"config.json: {len(self.layers)} layer geometries for "
                f"{self.num_hidden_layers} layers"
            )
        for i, spec in enumerate(self.layers):
            if spec.head_dim <= 0 or spec.num_key_value_heads <= 0 or spec.intermediate_size <= 0:
                raise CheckpointError(f"config.json: layer {i} has a non-positive size")
            if self.num_attention_heads % spec.num_key_value_heads:
                raise CheckpointError(
                    f"config.json: num_attention_heads ({self.num_attention_heads}) must be a "
                    f"multiple of layer {i}'s key/value heads ({spec.num_key_value_heads})"
                )
            src = spec.kv_source
            if src != i and not (
                0 <= src < i
                and self.layers[src].kv_source == src
                and self.layer_types[src] is self.layer_types[i]
                and (self.layers[src].head_dim, self.layers[src].num_key_value_heads)
                == (spec.head_dim, spec.num_key_value_heads)
            ):
                raise CheckpointError(
                    f"config.json: layer {i} cannot share the keys and values of layer {src}"
                )
        for kind in set(self.layer_types):  # one rope table per type, at one head size
            dims = {
                s.head_dim for s, t in zip(self.layers, self.layer_types, strict=True) if t is kind
            }
            if len(dims) > 1:
                raise UnsupportedModelError(
                    f"config.json: {kind.value} layers have different head sizes {sorted(dims)}"
                )
        for name in (
            "hidden_size_per_layer_input",
            "vocab_size_per_layer_input",
            "num_experts",
            "moe_intermediate_size",
            "altup_num_inputs",
            "laurel_rank",
        ):
            if getattr(self, name) < 0:
                raise CheckpointError(f"config.json: {name} must not be negative")
        if self.hidden_size_per_layer_input and self.vocab_size_per_layer_input <= 0:
            raise CheckpointError(
                "config.json: per-layer embeddings need vocab_size_per_layer_input"
            )
        if self.num_experts and not 0 < self.top_k_experts <= self.num_experts:
            raise CheckpointError(
                f"config.json: top_k_experts ({self.top_k_experts}) must be from 1 to "
                f"num_experts ({self.num_experts})"
            )
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise CheckpointError("config.json: a mixture of experts needs moe_intermediate_size")
        if self.altup_num_inputs and not 0 <= self.altup_active_idx < self.altup_num_inputs:
            raise CheckpointError(
                f"config.json: altup_active_idx ({self.altup_active_idx}) must be below "
                f"altup_num_inputs ({self.altup_num_inputs})"
            )

    @property
    def has_sliding_layers(self) -> bool:
        return AttentionType.SLIDING in self.layer_types

    def rope_head_dim(self, kind: AttentionType) -> int:
        """The head size of ``kind``'s layers, which its rope table is built for."""
        for spec, t in zip(self.layers, self.layer_types, strict=True):
            if t is kind:
                return spec.head_dim
        return self.head_dim

    @property
    def first_kv_shared_layer(self) -> int | None:
        """The first layer that reads another layer's keys and values (all after it do too)."""
        shared = [i for i, spec in enumerate(self.layers) if spec.kv_source != i]
        return shared[0] if shared else None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GemmaConfig:
        """Map a Hugging Face config.json dict onto this dataclass, explicitly."""
        if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type", ""), str):
            raise CheckpointError("config.json must be a JSON object with a string model_type")
        model_type = cfg.get("model_type")
        if model_type in _WRAPPERS:  # multimodal wrapper: the text model lives in text_config
            model_type = _WRAPPERS[model_type]
            text = cfg.get("text_config") or {}
            if not isinstance(text, dict):
                raise CheckpointError("config.json: text_config must be a JSON object")
            cfg = {**text, "model_type": model_type}
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; gemma-engine runs {_ACCEPTED}"
            )
        cfg = {**_DEFAULTS.get(model_type, {}), **cfg}
        check_hf_config(cfg)
        # null means "not set" (a key's default, or none), never a value to compute with.
        cfg = {key: value for key, value in cfg.items() if value is not None}

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise CheckpointError(f"config.json has no {key!r}, which a {model_type} needs")
            return cfg[key]

        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _TANH_GELU_NAMES:
            raise UnsupportedModelError(f"config.json: activation {act!r} is not Gemma's GELU")
        if cfg.get("attention_bias"):
            raise UnsupportedModelError("config.json: attention_bias is set; Gemma has no biases")
        if cfg.get("use_bidirectional_attention") == "all":  # "vision" touches image tokens only
            raise UnsupportedModelError(
                "config.json: use_bidirectional_attention='all' (bidirectional text attention) "
                "is not supported; gemma-engine runs causal decoders"
            )
        layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        gen2plus = model_type != "gemma"
        new_gen = model_type in ("gemma3n_text", "gemma4_text")  # Gemma 3n and 4 share these
        layer_types = _layer_types(cfg, model_type, layers)
        specs = _layer_specs(cfg, model_type, layer_types, head_dim, kv_heads)
        rope_global, rope_local = _rope_configs(cfg, model_type)
        moe = model_type == "gemma4_text" and bool(cfg.get("enable_moe_block"))
        altup = model_type == "gemma3n_text"
        eos = cfg.get("eos_token_id", 1)
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=max(s.intermediate_size for s in specs),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            query_pre_attn_scalar=1.0
            if new_gen
            else float(cfg.get("query_pre_attn_scalar") or head_dim),
            layer_types=layer_types,
            rope_global=rope_global,
            rope_local=rope_local,
            sliding_window=cfg.get("sliding_window") if gen2plus else None,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            sandwich_norms=gen2plus,
            qk_norm=model_type == "gemma3_text" or new_gen,
            norm_offset=0.0 if new_gen else 1.0,
            v_norm=new_gen,
            layer_scalar=model_type == "gemma4_text",
            layers=specs,
            hidden_size_per_layer_input=int(cfg.get("hidden_size_per_layer_input") or 0)
            if new_gen
            else 0,
            vocab_size_per_layer_input=int(cfg.get("vocab_size_per_layer_input") or 0)
            if new_gen
            else 0,
            num_experts=int(need("num_experts")) if moe else 0,
            top_k_experts=int(need("top_k_experts")) if moe else 0,
            moe_intermediate_size=int(need("moe_intermediate_size")) if moe else 0,
            altup_num_inputs=int(need("altup_num_inputs")) if altup else 0,
            altup_active_idx=int(cfg.get("altup_active_idx") or 0) if altup else 0,
            altup_correct_scale=bool(cfg.get("altup_correct_scale")) if altup else False,
            laurel_rank=int(need("laurel_rank")) if altup else 0,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            bos_token_id=int(cfg.get("bos_token_id", 2)),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
            pad_token_id=int(cfg.get("pad_token_id") or 0),
            extra=dict(cfg),
        )


# transformers 5.24's class defaults (configuration_gemma3n.py, configuration_gemma4.py) for the
# keys a Gemma 3n/4 config.json may leave out; they apply only where a key is absent.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3n_text": {
        "head_dim": 256,
        "sliding_window": 512,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 32_768,
        "num_kv_shared_layers": 15,
        "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262_144,
        "altup_num_inputs": 4,
        "altup_active_idx": 0,
        "altup_correct_scale": True,
        "laurel_rank": 64,
    },
    "gemma4_text": {
        "head_dim": 256,
        "global_head_dim": 512,
        "sliding_window": 512,
        "max_position_embeddings": 131_072,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262_144,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
            },
        },
    },
}


def _layer_specs(
    cfg: dict[str, Any],
    model_type: str,
    layer_types: tuple[AttentionType, ...],
    head_dim: int,
    kv_heads: int,
) -> tuple[LayerSpec, ...]:
    """Each layer's geometry, KV source and MLP width, from whichever keys the config uses."""
    n = len(layer_types)
    dims, kvs = [head_dim] * n, [kv_heads] * n
    if model_type == "gemma4_text":
        dims, kvs = _gemma4_geometry(cfg, layer_types, head_dim, kv_heads)
    shared = (
        int(cfg.get("num_kv_shared_layers") or 0)
        if model_type.startswith(("gemma3n", "gemma4"))
        else 0
    )
    sources = _kv_sources(shared, layer_types)
    width = cfg.get("intermediate_size")
    if isinstance(width, list):  # Gemma 3n: one width per layer
        if len(width) != n:
            raise CheckpointError(
                f"config.json: intermediate_size lists {len(width)} widths for {n} layers"
            )
        widths = [int(w) for w in width]
    elif width is None:
        raise CheckpointError(f"config.json has no 'intermediate_size', which a {model_type} needs")
    else:
        widths = [int(width)] * n
    if model_type == "gemma4_text" and cfg.get("use_double_wide_mlp"):
        # Gemma 4 E2B: the KV-shared layers' MLPs are twice as wide.
        widths = [w * 2 if sources[i] != i else w for i, w in enumerate(widths)]
    k_eq_v = model_type == "gemma4_text" and bool(cfg.get("attention_k_eq_v"))
    sparsity = _activation_sparsity(cfg, n) if model_type == "gemma3n_text" else [0.0] * n
    return tuple(
        LayerSpec(
            head_dim=dims[i],
            num_key_value_heads=kvs[i],
            intermediate_size=widths[i],
            kv_source=sources[i],
            k_eq_v=k_eq_v and layer_types[i] is AttentionType.GLOBAL,
            activation_sparsity=sparsity[i],
        )
        for i in range(n)
    )


def _gemma4_geometry(
    cfg: dict[str, Any], layer_types: tuple[AttentionType, ...], head_dim: int, kv_heads: int
) -> tuple[list[int], list[int]]:
    """Per-layer (head_dim, kv heads) of Gemma 4, from either form a config may take.

    The hub's config.json files give ``global_head_dim`` and ``num_global_key_value_heads`` for
    the full layers (the latter only when ``attention_k_eq_v``); transformers 5.24 turns them into
    ``per_layer_config`` and saves that instead: ``{"2": {"head_dim": 512, ...}, ...}``.
    """
    n = len(layer_types)
    dims, kvs = [head_dim] * n, [kv_heads] * n
    per_layer = cfg.get("per_layer_config")
    if per_layer is not None:
        if not isinstance(per_layer, dict):
            raise CheckpointError("config.json: per_layer_config must map layer indices to dicts")
        for key, override in per_layer.items():
            try:
                i = int(key)
            except ValueError:
                raise CheckpointError(
                    f"config.json: per_layer_config key {key!r} is not a layer index"
                ) from None
            if not 0 <= i < n or not isinstance(override, dict):
                raise CheckpointError(
                    f"config.json: per_layer_config entry {key!r} is not a layer of {n}"
                )
            unknown = sorted(set(override) - {"head_dim", "num_key_value_heads"})
            if unknown:
                raise UnsupportedModelError(
                    f"config.json: per_layer_config overrides {', '.join(unknown)} on layer {i}; "
                    "gemma-engine supports per-layer head_dim and num_key_value_heads only"
                )
            dims[i] = int(override.get("head_dim", head_dim))
            kvs[i] = int(override.get("num_key_value_heads", kv_heads))
        return dims, kvs
    if cfg.get("global_head_dim") is None:
        raise CheckpointError("config.json: global_head_dim is null; a gemma4_text needs it")
    global_kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
    for i, t in enumerate(layer_types):
        if t is AttentionType.GLOBAL:
            dims[i] = int(cfg["global_head_dim"])
            kvs[i] = int(global_kv or kv_heads)
    return dims, kvs


def _kv_sources(shared: int, layer_types: tuple[AttentionType, ...]) -> list[int]:
    """The layer each layer takes its keys and values from (Gemma 3n/4 KV sharing).

    The last ``shared`` layers compute no keys or values: each reads those of the last earlier,
    non-shared layer of its own type, as transformers' ``kv_sharing_modes`` has it.
    """
    n = len(layer_types)
    if not shared:
        return list(range(n))
    if not 0 < shared < n:
        raise CheckpointError(
            f"config.json: num_kv_shared_layers ({shared}) must be below num_hidden_layers ({n})"
        )
    first = n - shared
    sources = list(range(n))
    for i in range(first, n):
        producers = [j for j in range(first) if layer_types[j] is layer_types[i]]
        if not producers:
            raise CheckpointError(
                f"config.json: KV-shared layer {i} ({layer_types[i].value}) has no earlier layer "
                "of its type to take keys and values from"
            )
        sources[i] = producers[-1]
    return sources


def _activation_sparsity(cfg: dict[str, Any], n: int) -> list[float]:
    """Gemma 3n's activation_sparsity_pattern: one target sparsity per layer."""
    pattern = cfg.get("activation_sparsity_pattern")
    if pattern is None:  # the class default: the first 10 layers of a deeper model
        sparse = 10 if n > 10 else 0
        pattern = [0.95] * sparse + [0.0] * (n - sparse)
    elif not isinstance(pattern, list):
        pattern = [pattern] * n
    if len(pattern) != n or not all(isinstance(p, (int, float)) and 0 <= p < 1 for p in pattern):
        raise CheckpointError(
            f"config.json: activation_sparsity_pattern must give {n} values in [0, 1)"
        )
    return [float(p) for p in pattern]


def _layer_types(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[AttentionType, ...]:
    types = _listed_or_patterned_layer_types(cfg, model_type, layers)
    if model_type == "gemma4_text" and types:
        # transformers forces Gemma 4's last layer to full attention, whatever the config says.
        types = (*types[:-1], AttentionType.GLOBAL)
    return types


def _listed_or_patterned_layer_types(
    cfg: dict[str, Any], model_type: str, layers: int
) -> tuple[AttentionType, ...]:
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
    default = 5 if model_type == "gemma3n_text" else 6  # 3n: [s x 4, f]; 3 and 4: [s x 5, f]
    pattern = int(
        cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default
    )
    return tuple(
        AttentionType.GLOBAL if (i + 1) % pattern == 0 else AttentionType.SLIDING
        for i in range(layers)
    )


def _rope_configs(cfg: dict[str, Any], model_type: str) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) rope settings from either the transformers-5 or the older keys."""
    # Gemma 3n's full layers default to theta 1e6 (its config class), the rest to 1e4.
    global_theta = 1_000_000.0 if model_type == "gemma3n_text" else 10_000.0

    def parse(params: dict[str, Any] | None, theta: float) -> RopeConfig:
        params = params or {}
        kind = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", theta))
        partial = float(params.get("partial_rotary_factor", 1.0))
        if kind == "proportional":
            return RopeConfig(theta, float(params.get("factor", 1.0)), partial)
        if partial != 1.0:
            raise UnsupportedModelError(
                f"config.json: partial_rotary_factor {partial} with rope type {kind!r} is not "
                "supported (only with 'proportional')"
            )
        if kind == "default":
            return RopeConfig(theta)
        if kind == "linear":
            return RopeConfig(theta, float(params["factor"]))
        raise UnsupportedModelError(f"config.json: rope type {kind!r} is not supported")

    params = cfg.get("rope_parameters")
    if params and ("full_attention" in params or "sliding_attention" in params):
        # transformers 5, one entry per attention type; Gemma 4 falls back per type to its own
        defaults = _DEFAULTS.get(model_type, {}).get("rope_parameters", {})
        rope_global = parse(
            params.get("full_attention") or defaults.get("full_attention"), global_theta
        )
        rope_local = parse(
            params.get("sliding_attention") or defaults.get("sliding_attention"), 10_000.0
        )
        return rope_global, rope_local
    theta = float(cfg.get("rope_theta", global_theta))
    rope_global = parse(params or cfg.get("rope_scaling"), theta)
    if model_type in ("gemma3_text", "gemma3n_text"):
        rope_local = RopeConfig(float(cfg.get("rope_local_base_freq", 10_000.0)))
    else:
        rope_local = rope_global
    return rope_global, rope_local
