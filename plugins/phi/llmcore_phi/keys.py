"""Every config.json key of Phi-3 / Phi-4-mini checkpoints, and what the plugin does with it.

Phi-3 (``model_type: phi3``, ``Phi3ForCausalLM``) is the Llama decoder with its q/k/v and
gate/up projections fused into one matrix each, so the table starts from the llama
plugin's (:data:`llmcore_llama.keys.HF_KEYS`: a key that changes the computation is
implemented or refused by name) and changes what differs:

* LongRoPE (``rope_type: longrope``, ``short_factor``/``long_factor``,
  ``original_max_position_embeddings``) and partial rotary (``partial_rotary_factor``:
  Phi-4-mini rotates 3/4 of each head): implemented by the llama plugin's RoPE for the
  families that ask for them;
* ``sliding_window`` on every layer (Phi-3-mini-4k: 2047);
* no attention or MLP biases: transformers' Phi3 has none.

Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from llmcore_llama import keys as llama_keys
from llmcore_llama.keys import DEFAULT_ONLY, HARMLESS, HF_KEYS, IMPLEMENTED, Key

PLUGIN = "phi"

_DROPOUT = "dropout: off at inference"
_REMOTE_ONLY = "read only by the custom modeling code some Phi checkpoints ship, not by transformers' Phi3"

PHI3_KEYS: dict[str, Key] = {
    **HF_KEYS,
    "model_type": Key(HARMLESS, "checked: must be phi3"),
    "architectures": Key(HARMLESS, "checked: Phi3ForCausalLM"),
    "original_max_position_embeddings": Key(IMPLEMENTED, "LongRoPE: the length past which the long factors apply"),
    "partial_rotary_factor": Key(IMPLEMENTED, "the fraction of each head RoPE rotates"),
    "sliding_window": Key(IMPLEMENTED, "a sliding window on every layer"),
    "resid_pdrop": Key(HARMLESS, _DROPOUT),
    "embd_pdrop": Key(HARMLESS, _DROPOUT),
    "attention_bias": Key(DEFAULT_ONLY, "biases on the attention projections: transformers' Phi3 has none", (False, None)),
    "lm_head_bias": Key(DEFAULT_ONLY, "a bias on the output layer", (False, None)),
    # Phi-4-mini's config.json: transformers loads model_type phi3 with its own class unless
    # asked to trust remote code, and so does llmcore; the keys only that code reads must
    # keep the values under which it is the same model.
    "auto_map": Key(HARMLESS, "custom modeling code: transformers' built-in Phi3 is what from_pretrained runs"),
    "full_attn_mod": Key(DEFAULT_ONLY, _REMOTE_ONLY, (1, None)),
    "interpolate_factor": Key(DEFAULT_ONLY, _REMOTE_ONLY, (1, None)),
}


def sliding_window(cfg: Mapping[str, Any]) -> dict:
    """The decoder's switches for Phi-3's ``sliding_window``, which applies to every layer
    (transformers builds a sliding mask whenever it is set)."""
    window = llama_keys.sliding_window(cfg.get("sliding_window"), plugin=PLUGIN)
    return {"sliding_window": window} if window else {}


# --------------------------------------------------------------------------------------
# GGUF metadata (llama.cpp's ``phi3`` architecture)
# --------------------------------------------------------------------------------------

GGUF_KEYS: dict[str, Key] = {
    "rope.dimension_count": Key(IMPLEMENTED, "the channels of each head RoPE rotates (Phi-4-mini: 3/4)"),
    "attention.sliding_window": Key(IMPLEMENTED, "a window on every layer, as transformers applies it; 0: none"),
    "rope.scaling.attn_factor": Key(IMPLEMENTED, "LongRoPE's factor on cos and sin"),
    "rope.scaling.original_context_length": Key(
        IMPLEMENTED, "LongRoPE: the length past which the long factors apply (a longer program is refused)"
    ),
}


def gguf_switches(view) -> dict:
    """The decoder switches a ``phi3`` GGUF's metadata sets (``view``: the llama plugin's
    :class:`~llmcore_llama.loaders.GGUFView`).

    * ``attention.sliding_window``: transformers' Phi3 slides every layer by it, and so
      does llmcore. (llama.cpp currently runs Phi-3 GGUFs without the window, so llmcore
      matches transformers, not llama.cpp, past the window.) 0 means none (Phi-4-mini).
    * LongRoPE: the converter stores the short and long factors as the tensors
      ``rope_factors_short`` / ``rope_factors_long`` and the attention factor as
      ``rope.scaling.attn_factor``. As for a Hugging Face folder, a program no longer than
      ``rope.scaling.original_context_length`` uses the short factors; a longer one would
      need the long factors from a length on and is refused.
    """
    out: dict = {}
    window = view.get("attention.sliding_window", 0)
    if window:
        out["sliding_window"] = llama_keys.sliding_window(window, f"{view.arch}.attention.sliding_window", PLUGIN)
    attention = view.get("rope.scaling.attn_factor")
    if attention is not None:
        out["rope_attention_factor"] = float(view.require("rope.scaling.attn_factor", float))
    has = {name: name in view.tensors for name in ("rope_factors_short.weight", "rope_factors_long.weight")}
    if not any(has.values()):
        return out
    if not all(has.values()):
        missing = next(name for name, present in has.items() if not present)
        raise view.refuse(f"LongRoPE needs both factor tensors, and {missing!r} is missing.",
                          "convert the model again with llama.cpp's convert_hf_to_gguf.py.")
    original = view.require("rope.scaling.original_context_length")
    wanted = view.max_seq_len or view.fields["max_seq_len"]
    if wanted > original:
        raise view.refuse(
            f"LongRoPE switches to its long factors once a sequence passes {original} positions "
            f"({view.arch}.rope.scaling.original_context_length), and a {wanted}-position program would need that, "
            f"which the {PLUGIN} plugin does not implement.",
            f"pass --max-seq-len {original} or less (within it, LongRoPE uses its short factors).",
        )
    short = view.tensor("rope_factors_short.weight").reshape(-1)
    width = view.fields["rotary_dim"] or view.fields["head_dim"] or view.fields["dim"] // view.fields["n_heads"]
    if short.numel() != width // 2 or not bool((short > 0).all()):
        raise view.refuse(f"'rope_factors_short.weight' must hold {width // 2} positive factors (one per rotated "
                          f"channel pair), not {short.numel()} values.",
                          "convert the model again with llama.cpp's convert_hf_to_gguf.py.")
    out["rope_freq_factors"] = tuple(float(v) for v in short.tolist())
    return out
