"""Tiny random Qwen2 / Qwen3 checkpoints written by transformers' own classes, and GGUFs
written from them as llama.cpp's converter writes Qwen.

The reference for every test is transformers' model read back from the same folder, so a
layout, bias or norm that llmcore reads differently shows in the logits.
"""

from __future__ import annotations

from pathlib import Path

from llmcore_llama import testing
from llmcore_llama.testing import save_random_hf

# Each family with the switches that make it differ from Llama; ``tie_word_embeddings`` as
# the small published sizes ship (Qwen2.5-0.5B, Qwen3-0.6B).
FAMILIES = {
    "qwen2": dict(kind="Qwen2", config=dict(tie_word_embeddings=True)),
    "qwen3": dict(kind="Qwen3", config=dict(head_dim=32, tie_word_embeddings=True)),  # 4 heads x 32 != 64
    "qwen3-bias": dict(kind="Qwen3", config=dict(head_dim=24, attention_bias=True, tie_word_embeddings=False)),
}


def hf_checkpoint(folder: Path, family: str, *, seed: int = 0, tokenizer: bool = True, **config) -> Path:
    """Save a random ``family`` model with transformers (see ``save_random_hf``)."""
    spec = FAMILIES[family]
    return save_random_hf(
        folder, spec["kind"], seed=seed, tokenizer=tokenizer, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **{**spec["config"], **config},
    )


def write_gguf(folder: Path, path: Path, quantize: dict | None = None) -> dict:
    """The checkpoint in ``folder`` as llama.cpp's converter writes Qwen2/Qwen3 (nothing
    beyond the common keys): see :func:`llmcore_llama.testing.write_gguf`."""
    return testing.write_gguf(folder, path, quantize=quantize)
