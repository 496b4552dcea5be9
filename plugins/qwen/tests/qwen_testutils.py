"""Tiny random Qwen2 / Qwen3 checkpoints written by transformers' own classes, and GGUFs
written from them as llama.cpp's converter writes Qwen.

The reference for every test is transformers' model read back from the same folder, so a
layout, bias or norm that llmcore reads differently shows in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

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
    """Convert the transformers checkpoint in ``folder`` to a GGUF as llama.cpp's
    convert_hf_to_gguf.py does for Qwen2/Qwen3: the gguf package's own tensor-name map, q/k
    rows left in Hugging Face's rotate-half order (llama.cpp runs them with NEOX RoPE),
    norms and biases in F32. ``quantize`` maps a GGUF suffix (``attn_q.weight``) to a
    GGMLQuantizationType for the 2-D weights. Returns {gguf name: (type, stored array)}."""
    import gguf
    from gguf import quants as gq
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = cfg["model_type"]
    names = gguf.get_tensor_name_map(
        {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[arch], cfg["num_hidden_layers"]
    )
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    stored = {}
    for hf_name, t in load_file(str(next(folder.glob("*.safetensors")))).items():
        base, _, kind = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{kind}"
        arr = t.float().numpy()
        qt = (quantize or {}).get(name.split(".", 2)[-1] if name.startswith("blk.") else name)
        if qt is None or arr.ndim != 2:
            qt, data = gguf.GGMLQuantizationType.F32, arr
            w.add_tensor(name, data)
        else:
            data = gq.quantize(arr, qt)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt)
        stored[name] = (qt, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored
