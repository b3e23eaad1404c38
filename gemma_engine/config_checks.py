"""config.json values checked before anything is computed or allocated from them.

Used by ``GemmaConfig.from_hf`` and by the GGUF import (whose metadata becomes a config).
"""

from __future__ import annotations

import math
from typing import Any

from .errors import CheckpointError

# A config.json (or the metadata of a GGUF file) comes with the weights, from whoever made them:
# wrong JSON types (true is not a layer count), zero or negative sizes, and sizes no Gemma comes
# near are refused here, naming the key, before a loop runs over a layer count or a product of
# sizes is taken. The bounds are far above every released Gemma (the largest: 62 layers, hidden
# 5376, vocabulary 262,208, context 131,072) and far below what would exhaust memory or time.
_INT_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 1 << 13),
    "global_head_dim": (1, 1 << 13),
    "num_global_key_value_heads": (1, 1024),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
    "sliding_window_pattern": (1, 1024),
    "_sliding_window_pattern": (1, 1024),
    "num_kv_shared_layers": (0, 1024),
    "hidden_size_per_layer_input": (0, 1 << 16),
    "vocab_size_per_layer_input": (0, 1 << 24),
    "num_experts": (0, 1 << 12),
    "top_k_experts": (0, 1 << 12),
    "moe_intermediate_size": (0, 1 << 20),
    "altup_num_inputs": (0, 64),
    "altup_active_idx": (0, 63),
    "laurel_rank": (0, 1 << 16),
    "bos_token_id": (0, (1 << 24) - 1),
    "pad_token_id": (0, (1 << 24) - 1),
}
# Finite and strictly positive where given (null means "not set" for every key here).
_POSITIVE_FLOATS = (
    "rms_norm_eps",
    "rope_theta",
    "rope_local_base_freq",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
)
_BOOLS = (
    "tie_word_embeddings",
    "attention_bias",
    "use_double_wide_mlp",
    "attention_k_eq_v",
    "enable_moe_block",
    "altup_correct_scale",
)
# No Gemma has 10^12 parameters; a config that implies more is refused before it is built.
MAX_PARAMETERS = 1 << 40


def check_hf_config(
    cfg: dict[str, Any], source: str = "config.json", names: dict[str, str] | None = None
) -> None:
    """Checks the types and ranges of the keys ``from_hf`` reads, where they are present.

    ``source`` and ``names`` (key -> what the user calls it, e.g. a GGUF metadata key) only
    shape the error message. Presence is checked where a key is used (``need``).
    """
    names = names or {}

    def bad(key: str, why: str) -> CheckpointError:
        alias = f" (metadata {names[key]})" if key in names else ""
        return CheckpointError(
            f"{source}: {key}{alias} {why}; the checkpoint is corrupted or not a Gemma model"
        )

    def whole(key: str, value: Any, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(key, f"must be a whole number, not {type(value).__name__} {value!r:.40}")
        if not low <= value <= high:
            raise bad(key, f"is {value:,}; it must be from {low:,} to {high:,}")
        return value

    def positive(key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(key, f"must be a number, not {type(value).__name__} {value!r:.40}")
        if not math.isfinite(value) or value <= 0:
            raise bad(key, f"is {value!r}; it must be a finite number above 0")

    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source} must hold a JSON object, not {type(cfg).__name__}")
    if not isinstance(cfg.get("model_type", ""), str):
        raise bad("model_type", "must be a string")
    for key, (low, high) in _INT_BOUNDS.items():
        value = cfg.get(key)
        if value is None:
            continue
        if key == "intermediate_size" and isinstance(value, list):  # Gemma 3n: one per layer
            if not value or len(value) > _INT_BOUNDS["num_hidden_layers"][1]:
                raise bad(key, f"lists {len(value)} widths")
            for width in value:
                whole(key, width, low, high)
            continue
        whole(key, value, low, high)
    for key in _POSITIVE_FLOATS:
        if cfg.get(key) is not None:
            positive(key, cfg[key])
    for key in _BOOLS:
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise bad(key, f"must be true or false, not {cfg[key]!r:.40}")
    eos = cfg.get("eos_token_id")
    for token in eos if isinstance(eos, list) else [] if eos is None else [eos]:
        whole("eos_token_id", token, 0, (1 << 24) - 1)
    vocab = cfg.get("vocab_size")
    for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
        ids = cfg.get(key)
        ids = ids if isinstance(ids, list) else [] if ids is None else [ids]
        if isinstance(vocab, int) and any(i >= vocab for i in ids):
            raise bad(key, f"is {cfg[key]}, outside the vocabulary of {vocab:,}")
    types = cfg.get("layer_types")
    if types is not None and (
        not isinstance(types, list)
        or len(types) > _INT_BOUNDS["num_hidden_layers"][1]
        or not all(isinstance(t, str) for t in types)
    ):
        raise bad("layer_types", "must be a list of strings, one per layer")
    for key in ("rope_scaling", "rope_parameters", "per_layer_config", "text_config"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise bad(key, f"must be an object, not {type(cfg[key]).__name__}")
    for params in _rope_dicts(cfg):
        for key in ("rope_theta", "factor", "partial_rotary_factor"):
            if params.get(key) is not None:
                positive(f"rope {key}", params[key])
        kind = params.get("rope_type", params.get("type", "default"))
        if not isinstance(kind, str):
            raise bad("rope_type", "must be a string")
    for key, override in (cfg.get("per_layer_config") or {}).items():
        if isinstance(override, dict):
            for field_name in ("head_dim", "num_key_value_heads"):
                if override.get(field_name) is not None:
                    low, high = _INT_BOUNDS[field_name]
                    whole(f"per_layer_config[{key}].{field_name}", override[field_name], low, high)
    _check_implied_size(cfg, bad)


def _rope_dicts(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key in ("rope_scaling", "rope_parameters"):
        params = cfg.get(key)
        if isinstance(params, dict):
            out.append(params)
            out += [v for v in params.values() if isinstance(v, dict)]  # one per layer type
    return out


def _check_implied_size(cfg: dict[str, Any], bad: Any) -> None:
    """A rough parameter count from the sizes given; absurd products are refused."""

    def size(key: str, default: int = 1) -> int:
        value = cfg.get(key)
        if isinstance(value, list):
            value = max(value)
        return value if isinstance(value, int) and value > 0 else default

    hidden, layers = size("hidden_size"), size("num_hidden_layers")
    heads, kv = size("num_attention_heads"), size("num_key_value_heads")
    head_dim = max(size("head_dim"), size("global_head_dim"))
    width = size("intermediate_size") + size("moe_intermediate_size") * size("num_experts")
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * width
    ple = size("vocab_size_per_layer_input") * size("hidden_size_per_layer_input") * layers
    total = size("vocab_size") * hidden + layers * per_layer + ple
    if total > MAX_PARAMETERS:
        raise bad(
            "hidden_size",
            f"and the other sizes imply about {total:.2e} parameters, far beyond any Gemma",
        )
