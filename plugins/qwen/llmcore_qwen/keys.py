"""Every config.json key of Qwen2/2.5 and Qwen3 checkpoints, and what the plugin does with it.

Qwen2 and Qwen3 are the Llama decoder with switches on, so the tables start from the llama
plugin's (:data:`llmcore_llama.keys.HF_KEYS`: the same rule, a key that changes the
computation is implemented or refused by name) and change what differs:

* Qwen2/2.5: biases on the q, k and v projections, always (transformers' ``Qwen2Attention``
  hard-codes them; it has no ``attention_bias`` key);
* Qwen3: an RMSNorm over each head of q and k before RoPE, always; ``attention_bias`` puts
  biases on q, k, v and o; ``head_dim`` independent of ``hidden_size``;
* both: sliding-window attention (``use_sliding_window``, ``sliding_window``,
  ``max_window_layers``, ``layer_types``) on the layers transformers picks
  (:func:`sliding_window_layers`).

Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from llmcore_llama.keys import DEFAULT_ONLY, HARMLESS, HF_KEYS, IMPLEMENTED, Key, refuse, sliding_window

PLUGIN = "qwen"

_SLIDING = {
    "use_sliding_window": Key(IMPLEMENTED, "turns sliding-window attention on"),
    "sliding_window": Key(IMPLEMENTED, "the window; read only with use_sliding_window"),
    "max_window_layers": Key(IMPLEMENTED, "layers from this index on slide (when layer_types is absent)"),
    "layer_types": Key(IMPLEMENTED, "full_attention or sliding_attention per layer"),
    # Qwen2-VL's multimodal RoPE (positions per time/height/width); some text configs carry it off
    "use_mrope": Key(DEFAULT_ONLY, "multimodal RoPE sections: text RoPE only", (False, None)),
}

QWEN2_KEYS: dict[str, Key] = {
    **HF_KEYS,
    **_SLIDING,
    "model_type": Key(HARMLESS, "checked: must be qwen2"),
    "architectures": Key(HARMLESS, "checked: Qwen2ForCausalLM"),
    "attention_bias": Key(
        HARMLESS, "not read by transformers' Qwen2: q/k/v always have biases, o never (the weights must match)"
    ),
}

QWEN3_KEYS: dict[str, Key] = {
    **HF_KEYS,
    **_SLIDING,
    "model_type": Key(HARMLESS, "checked: must be qwen3"),
    "architectures": Key(HARMLESS, "checked: Qwen3ForCausalLM"),
    "attention_bias": Key(IMPLEMENTED, "biases on the q/k/v/o projections"),
}


def sliding_window_layers(cfg: Mapping[str, Any]) -> tuple[int, list[int]]:
    """``(window, indices of the layers that slide)`` as transformers decides them, or
    ``(0, [])`` when no layer slides.

    transformers (5.x) uses the window only with ``use_sliding_window``; the layers that
    slide are those ``layer_types`` marks ``sliding_attention``, or, without it, those from
    ``max_window_layers`` on.
    """
    n_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers:
            raise refuse(
                f"config.json key 'layer_types' must list one attention type per layer ({n_layers}), "
                f"not {types!r:.80}.",
                "check the config.json of the checkpoint.",
                PLUGIN,
            )
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")}, key=str)
        if unknown:
            raise refuse(
                f"config.json key 'layer_types' holds {unknown[0]!r}, an attention type the qwen plugin does not "
                "implement (it implements full_attention and sliding_attention).",
                "use a checkpoint whose layers use full or sliding-window attention.",
                PLUGIN,
            )
    window = sliding_window(cfg.get("sliding_window"), plugin=PLUGIN) if cfg.get("use_sliding_window") else None
    if window is None:
        return 0, []
    if types is not None:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    else:
        first = int(cfg.get("max_window_layers") or 0)
        sliding = list(range(first, n_layers))
    return (window, sliding) if sliding else (0, [])
