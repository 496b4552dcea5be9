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
