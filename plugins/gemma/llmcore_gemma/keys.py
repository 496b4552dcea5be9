"""Every config.json key of Gemma, Gemma 2 and Gemma 3 (text) checkpoints, and what the
plugin does with it.

The Gemma decoders are the Llama decoder with switches on, so the tables start from the
llama plugin's (:data:`llmcore_llama.keys.HF_KEYS`: a key that changes the computation is
implemented or refused by name) and change what differs:

* all: embeddings times ``sqrt(hidden_size)``; RMSNorms that multiply by ``1 + w`` (folded
  into the weights at load); GeGLU with the tanh GELU (``hidden_activation``, Gemma 1's
  ``hidden_act``); ``head_dim`` of its own;
* Gemma 2 and 3: a norm on each sublayer's output too; ``query_pre_attn_scalar`` sets the
  attention scale; sliding-window layers alternating with global ones (``layer_types``,
  or Gemma 3's ``sliding_window_pattern``);
* Gemma 2: soft-capped attention scores and logits;
* Gemma 3: per-head q/k norms, a RoPE base of their own for the sliding layers
  (``rope_local_base_freq``, or ``rope_parameters.sliding_attention``), RoPE scaling on the
  global layers only.

Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from llmcore_llama.keys import DEFAULT_ONLY, HARMLESS, HF_KEYS, IMPLEMENTED, Key, hf_rope, refuse, sliding_window

PLUGIN = "gemma"

_GELU_TANH = ("gelu_pytorch_tanh",)

_COMMON = {
    **HF_KEYS,
    "attention_bias": Key(IMPLEMENTED, "biases on the q/k/v/o projections"),
    "use_bidirectional_attention": Key(DEFAULT_ONLY, "bidirectional (encoder) attention", (False, None)),
    "architectures": Key(HARMLESS, "checked with model_type"),
    "model_type": Key(HARMLESS, "checked: gemma, gemma2 or gemma3_text"),
}

_GEMMA2_AND_3 = {
    "hidden_activation": Key(DEFAULT_ONLY, "the GeGLU activation", _GELU_TANH),
    # Hub configs of Gemma 2/3 carry Gemma 1's key too; their transformers classes read hidden_activation
    "hidden_act": Key(HARMLESS, "not read by transformers' Gemma 2/3 (hidden_activation is)"),
    "query_pre_attn_scalar": Key(IMPLEMENTED, "the attention scale is its inverse square root"),
    "sliding_window": Key(IMPLEMENTED, "the window of the sliding layers"),
    "layer_types": Key(IMPLEMENTED, "full_attention or sliding_attention per layer"),
    "cache_implementation": Key(HARMLESS, "transformers' cache class (hybrid): the program's cache is llmcore's"),
}

GEMMA_KEYS: dict[str, Key] = {
    **_COMMON,
    # transformers turns Gemma 1's legacy "gelu" into the tanh approximation it was trained with
    "hidden_act": Key(DEFAULT_ONLY, "the GeGLU activation (legacy gelu means the tanh approximation)",
                      ("gelu_pytorch_tanh", "gelu")),
    "hidden_activation": Key(DEFAULT_ONLY, "the GeGLU activation", ("gelu_pytorch_tanh", None)),
}

GEMMA2_KEYS: dict[str, Key] = {
    **_COMMON,
    **_GEMMA2_AND_3,
    "attn_logit_softcapping": Key(IMPLEMENTED, "attention scores become cap * tanh(scores / cap)"),
    "final_logit_softcapping": Key(IMPLEMENTED, "logits become cap * tanh(logits / cap)"),
}

GEMMA3_KEYS: dict[str, Key] = {
    **_COMMON,
    **_GEMMA2_AND_3,
    "final_logit_softcapping": Key(IMPLEMENTED, "logits become cap * tanh(logits / cap)"),
    # Gemma3TextConfig has the key but transformers' Gemma3 attention never applies it; a
    # checkpoint that sets it would be computed differently by whoever reads it.
    "attn_logit_softcapping": Key(DEFAULT_ONLY, "attention soft-capping: transformers' Gemma 3 does not apply it", (None,)),
    "rope_local_base_freq": Key(IMPLEMENTED, "RoPE base of the sliding layers, legacy form"),
    "sliding_window_pattern": Key(IMPLEMENTED, "every N-th layer is global (when layer_types is absent)"),
    "_sliding_window_pattern": Key(IMPLEMENTED, "as sliding_window_pattern, as transformers 5 saves it"),
}

TABLES = {"gemma": GEMMA_KEYS, "gemma2": GEMMA2_KEYS, "gemma3_text": GEMMA3_KEYS}


def _positive(cfg: Mapping[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise refuse(f"config.json key {key!r} = {value!r} is not a positive number.",
                     "check the config.json of the checkpoint.", PLUGIN)
    return float(value)


def sliding_layers(cfg: Mapping[str, Any], model_type: str) -> list[int]:
    """Indices of the sliding layers as transformers decides them: ``layer_types`` when
    given, else Gemma 2's every other layer from the first, or Gemma 3's all but every
    ``sliding_window_pattern``-th (6 by default)."""
    n_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers:
            raise refuse(f"config.json key 'layer_types' must list one attention type per layer ({n_layers}), "
                         f"not {types!r:.80}.", "check the config.json of the checkpoint.", PLUGIN)
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")}, key=str)
        if unknown:
            raise refuse(f"config.json key 'layer_types' holds {unknown[0]!r}, an attention type the gemma plugin "
                         "does not implement (it implements full_attention and sliding_attention).",
                         "use a checkpoint whose layers use full or sliding-window attention.", PLUGIN)
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if model_type == "gemma2":
        return [i for i in range(n_layers) if (i + 1) % 2]
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise refuse(f"config.json key 'sliding_window_pattern' = {pattern!r} is not a positive number of layers.",
                     "check the config.json of the checkpoint.", PLUGIN)
    return [i for i in range(n_layers) if (i + 1) % pattern]


def global_rope(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config the global (full-attention) layers' RoPE is read from. Gemma 3 nests
    ``rope_parameters`` per layer type in transformers 5; its legacy form has the global
    ``rope_theta`` / ``rope_scaling`` at the top level (and ``rope_local_base_freq``)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and any(isinstance(v, Mapping) for v in params.values()):
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            raise refuse(f"config.json key 'rope_parameters.{unknown[0]}' names a layer type the gemma plugin does "
                         "not know (it reads full_attention and sliding_attention).",
                         "check the config.json of the checkpoint.", PLUGIN)
        view = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_local_base_freq")}
        view["rope_parameters"] = params.get("full_attention") or {"rope_type": "default", "rope_theta": 1_000_000.0}
        return view
    view = {k: v for k, v in cfg.items() if k != "rope_local_base_freq"}
    if view.get("rope_theta") is None and not params:
        view["rope_theta"] = 1_000_000.0  # Gemma3TextConfig's default global base
    return view


def local_rope_theta(cfg: Mapping[str, Any]) -> float:
    """The RoPE base of Gemma 3's sliding layers: ``rope_parameters.sliding_attention``
    (which must be unscaled) or the legacy ``rope_local_base_freq`` (default 1e4)."""
    params = cfg.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, Mapping) else None
    if isinstance(local, Mapping):
        rope = hf_rope({"rope_parameters": local}, plugin=PLUGIN)
        if rope.scaling is not None or rope.linear != 1.0 or rope.freq_factors is not None:
            raise refuse("config.json key 'rope_parameters.sliding_attention' scales the RoPE of the sliding layers, "
                         "which the gemma plugin does not implement (it scales the global layers').",
                         "use a checkpoint whose sliding layers use the default RoPE.", PLUGIN)
        return rope.theta
    if local is not None:
        raise refuse(f"config.json key 'rope_parameters.sliding_attention' = {local!r:.60} is not an object.",
                     "check the config.json of the checkpoint.", PLUGIN)
    return _positive(cfg, "rope_local_base_freq") or 10_000.0


def switches(cfg: Mapping[str, Any], model_type: str) -> dict:
    """The decoder switches (:class:`llmcore_llama.config.LlamaConfig` fields) of a Gemma
    config.json."""
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    bias = bool(cfg.get("attention_bias") or False)
    out = {
        "embedding_multiplier": float(int(cfg["hidden_size"])) ** 0.5,
        "ffn_activation": "gelu_tanh",
        "qkv_bias": bias,
        "o_bias": bias,
    }
    if model_type == "gemma":
        return out
    scalar = _positive(cfg, "query_pre_attn_scalar") or 256.0
    out["sandwich_norms"] = True
    if scalar != head_dim:
        out["attention_scale"] = scalar ** -0.5
    out["final_softcap"] = _positive(cfg, "final_logit_softcapping")
    if model_type == "gemma2":
        out["attn_softcap"] = _positive(cfg, "attn_logit_softcapping")
    layers = sliding_layers(cfg, model_type)
    window = sliding_window(cfg.get("sliding_window"), plugin=PLUGIN)
    if layers:  # without a window, transformers' sliding layers attend to everything (and Gemma 3's keep their RoPE)
        out["sliding_window"], out["sliding_layers"] = window, tuple(layers)
    if model_type == "gemma3_text":
        out["qk_norm"] = True
        local = local_rope_theta(cfg)
        if layers:
            out["rope_local_theta"] = local
    return out


# --------------------------------------------------------------------------------------
# GGUF metadata (llama.cpp's ``gemma``, ``gemma2`` and ``gemma3`` architectures)
# --------------------------------------------------------------------------------------
#
# llama.cpp's converter folds Gemma's ``1 + w`` into every norm weight (so nothing is folded
# at load) and keeps q/k rows in rotate-half order. What config.json says in keys, llama.cpp
# partly hard-codes per architecture, and a GGUF means what llama.cpp computes from it:
# the defaults below are llama.cpp's (llama-hparams.h, models/gemma*.cpp).

GGUF_KEYS: dict[str, Key] = {
    "attn_logit_softcapping": Key(IMPLEMENTED, "Gemma 2: attention scores become cap * tanh(scores / cap)"),
    "final_logit_softcapping": Key(IMPLEMENTED, "Gemma 2 and 3: logits become cap * tanh(logits / cap)"),
    "attention.sliding_window": Key(IMPLEMENTED, "the window of the sliding layers"),
    "attention.sliding_window_pattern": Key(
        IMPLEMENTED, "which layers slide: every N-th is global, or one flag per layer"
    ),
    "rope.freq_base_swa": Key(IMPLEMENTED, "RoPE base of the sliding layers"),
}

# llama.cpp's defaults where a key is absent
_GGUF_GEMMA2_WINDOW = 4096
_GGUF_ATTN_SOFTCAP, _GGUF_FINAL_SOFTCAP = 50.0, 30.0
_GGUF_PATTERN = {"gemma2": 2, "gemma3": 6}
_GGUF_GEMMA3_LOCAL_THETA = 10_000.0
# llama.cpp scales q by (dim / heads) ** -0.5 instead of head_dim ** -0.5 for the 27B sizes
# (as Google's reference code does), recognised by their layer counts.
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gguf_sliding_layers(view, n_layers: int) -> list[int]:
    """The sliding layers as llama.cpp reads ``attention.sliding_window_pattern``: one flag
    per layer, or N (layer i slides unless i % N == N - 1; 2 for Gemma 2, 6 for Gemma 3)."""
    pattern = view.get("attention.sliding_window_pattern", _GGUF_PATTERN[view.arch])
    if isinstance(pattern, list):
        if len(pattern) != n_layers or not all(isinstance(p, (bool, int)) for p in pattern):
            raise view.refuse(f"'{view.arch}.attention.sliding_window_pattern' must hold one flag per layer "
                              f"({n_layers}), not {pattern!r:.60}.",
                              "convert the model again with llama.cpp's convert_hf_to_gguf.py.")
        return [i for i, slides in enumerate(pattern) if slides]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise view.refuse(f"'{view.arch}.attention.sliding_window_pattern' = {pattern!r} is not a number of layers.",
                          "convert the model again with llama.cpp's convert_hf_to_gguf.py.")
    return [i for i in range(n_layers) if pattern == 0 or i % pattern < pattern - 1]


def gguf_switches(view) -> dict:
    """The decoder switches of a Gemma GGUF (``view``: the llama plugin's
    :class:`~llmcore_llama.loaders.GGUFView`), as llama.cpp computes the model."""
    fields = view.fields
    out = {"embedding_multiplier": float(fields["dim"]) ** 0.5, "ffn_activation": "gelu_tanh"}
    if view.get("attn_logit_softcapping") is not None and view.arch != "gemma2":
        raise view.refuse(f"'{view.arch}.attn_logit_softcapping' is set, but llama.cpp's {view.arch} does not "
                          "apply attention soft-capping, so what the file means is unclear.",
                          "convert the model again with llama.cpp's convert_hf_to_gguf.py.")
    if view.arch == "gemma":
        for suffix in ("final_logit_softcapping", "attention.sliding_window", "attention.sliding_window_pattern",
                       "rope.freq_base_swa"):
            if view.get(suffix) is not None:
                raise view.refuse(f"'{view.arch}.{suffix}' is set, but llama.cpp's gemma (1) ignores it, so what "
                                  "the file means is unclear.",
                                  "convert the model again with llama.cpp's convert_hf_to_gguf.py.")
        return out
    n_layers = fields["n_layers"]
    out["sandwich_norms"] = True
    if n_layers == _GGUF_27B_LAYERS[view.arch]:
        out["attention_scale"] = (fields["dim"] // fields["n_heads"]) ** -0.5
    final = float(view.get("final_logit_softcapping", _GGUF_FINAL_SOFTCAP if view.arch == "gemma2" else 0.0))
    out["final_softcap"] = final or None
    if view.arch == "gemma2":
        out["attn_softcap"] = float(view.get("attn_logit_softcapping", _GGUF_ATTN_SOFTCAP)) or None
        window = int(view.get("attention.sliding_window", _GGUF_GEMMA2_WINDOW))
    else:
        window = int(view.get("attention.sliding_window", 0))
    layers = gguf_sliding_layers(view, n_layers) if window > 0 else []
    if not layers:
        return out
    out["sliding_window"], out["sliding_layers"] = window, tuple(layers)
    local = view.get("rope.freq_base_swa")
    if view.arch == "gemma3":
        # llama.cpp: the sliding layers' base defaults to 1e4 and they are never scaled
        out["rope_local_theta"] = float(local if local is not None else _GGUF_GEMMA3_LOCAL_THETA)
    elif local is not None:
        # Gemma 2: llama.cpp scales the sliding layers as the global ones; llmcore's second
        # table is unscaled, so a file that scales and sets the base is refused
        if fields["rope_linear_factor"] != 1.0:
            raise view.refuse(f"'{view.arch}.rope.freq_base_swa' with a RoPE scaling factor: llama.cpp scales the "
                              "sliding layers too, which the gemma plugin does not implement.",
                              "use a GGUF without RoPE scaling.")
        out["rope_local_theta"] = float(local)
    return out
