"""llmcore-phi: the Phi-3 and Phi-4-mini model families.

Phi-3 (and Phi-4-mini, which transformers runs with the same ``Phi3ForCausalLM``) is the
Llama decoder with its q/k/v projections fused into ``qkv_proj`` and gate/up into
``gate_up_proj``, LongRoPE, and (Phi-4-mini) RoPE on 3/4 of each head. This plugin composes
the llama plugin's decoder, HF loader, RoPE and config-key rules (:mod:`llmcore_llama`):
what it adds is splitting the fused matrices at load, which keys Phi checkpoints carry
(:mod:`.keys`), and random configurations for tests. The split matrices export as separate
linears, as they are in Llama, which XNNPACK lowers into one delegate per layer.

The hook only describes the family; torch and the loaders are imported when a factory runs.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmcore.hookspecs import hookimpl
from llmcore.records import LoadedModel, LoadOptions, ModelFamily

__version__ = "0.1.0"
__all__ = ["llmcore_model_families", "family", "load_hf", "load_gguf", "hf_architecture", "gguf_architecture",
           "unfuse"]

MODEL_TYPES = ("phi3",)


def _configs() -> dict:
    from llmcore_llama.config import LlamaConfig

    tiny = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=320, hidden_dim=192, norm_eps=1e-5,
                rope_theta=10000.0, max_seq_len=128)
    # SmolLM2-135M's shape with Phi-4-mini's partial rotary: for export timings next to llama's.
    smol = dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, hidden_dim=1536, norm_eps=1e-5,
                rope_theta=10000.0, max_seq_len=4096, tie_embeddings=True)
    return {
        "phi3-tiny": LlamaConfig(**tiny),
        "phi4-mini-tiny": LlamaConfig(**{**tiny, "n_kv_heads": 2}, tie_embeddings=True, rotary_dim=12,
                                      rope_freq_factors=(1.0, 1.2, 1.5, 2.0, 3.0, 4.0), rope_attention_factor=1.19),
        "phi4-mini-135m": LlamaConfig(**smol, rotary_dim=48),
    }


CONFIG_DESCRIPTIONS = {
    "phi3-tiny": "Phi-3 layout, dim 64, 2 layers, 4 heads (no GQA), vocab 320 (byte-level BPE), untied",
    "phi4-mini-tiny": "Phi-4-mini layout: GQA 4/2, RoPE on 12 of 16 channels, LongRoPE short factors, tied, vocab 320",
    "phi4-mini-135m": "SmolLM2-135M's shape (dim 576, 30 layers, 9/3 heads, ffn 1536, vocab 49152) with RoPE on 48 "
    "of 64 channels",
}


def unfuse(hf: dict, config) -> dict:
    """Split ``qkv_proj`` (rows: q heads, k heads, v heads) and ``gate_up_proj`` (rows: gate,
    then up, as transformers' ``chunk(2)``) into Llama's Hugging Face names. A fused matrix
    of the wrong height is kept under its own name, for the loader to report as unexpected."""
    q_rows = config.n_heads * config.resolved_head_dim
    kv_rows = config.n_kv_heads * config.resolved_head_dim
    out = {}
    for name, t in hf.items():
        m = re.match(r"^(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$", name)
        if m is None:
            out[name] = t
        elif m.group(2) == "self_attn.qkv_proj" and t.shape[0] == q_rows + 2 * kv_rows:
            q, k, v = t.split([q_rows, kv_rows, kv_rows])
            for part, w in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{m.group(1)}self_attn.{part}.weight"] = w
        elif m.group(2) == "mlp.gate_up_proj" and t.shape[0] == 2 * config.hidden_dim:
            gate, up = t.chunk(2)
            out[f"{m.group(1)}mlp.gate_proj.weight"] = gate
            out[f"{m.group(1)}mlp.up_proj.weight"] = up
        else:
            out[name] = t
    return out


def hf_architecture():
    """The llama plugin's :class:`~llmcore_llama.loaders.HFArchitecture` for Phi-3."""
    from llmcore_llama import keys as llama_keys
    from llmcore_llama.loaders import HFArchitecture

    from . import keys

    def switches(cfg, max_seq_len: int) -> dict:
        return keys.sliding_window(cfg)

    return HFArchitecture(
        keys.PLUGIN, MODEL_TYPES, ("Phi3ForCausalLM",), keys.PHI3_KEYS, switches, default_norm_eps=1e-5,
        rope_features=frozenset({llama_keys.LONGROPE, llama_keys.PARTIAL_ROTARY}), adapt=unfuse,
    )


# llama.cpp's fused Phi-3 matrices, stacked as in Hugging Face: ``attn_qkv`` holds q, k and
# v; ``ffn_up`` holds gate then up (llama.cpp's SwiGLU takes the first half as the gate).
def _qkv_rows(config) -> tuple:
    width = config.resolved_head_dim
    return (("attention.wq.weight", config.n_heads * width), ("attention.wk.weight", config.n_kv_heads * width),
            ("attention.wv.weight", config.n_kv_heads * width))


def _gate_up_rows(config) -> tuple:
    return (("feed_forward.w1.weight", config.hidden_dim), ("feed_forward.w3.weight", config.hidden_dim))


def gguf_architecture():
    """The llama plugin's :class:`~llmcore_llama.loaders.GGUFArchitecture` for llama.cpp's
    ``phi3`` GGUFs (Phi-3, Phi-3.5-mini, Phi-4-mini): fused matrices split at load, q/k rows
    in rotate-half order (llama.cpp's NEOX RoPE), partial rotary from
    ``rope.dimension_count``, LongRoPE factors stored as tensors (:func:`keys.gguf_switches`)."""
    from llmcore_llama.loaders import GGUFArchitecture

    from . import keys

    return GGUFArchitecture(
        keys.PLUGIN, MODEL_TYPES, rotate_half=True, keys=keys.GGUF_KEYS, switches=keys.gguf_switches,
        fused={"attn_qkv.weight": _qkv_rows, "ffn_up.weight": _gate_up_rows},
        metadata_tensors=("rope_factors_short.weight", "rope_factors_long.weight"), partial_rotary=True,
    )


def load_gguf(path: Path, options: LoadOptions) -> LoadedModel:
    """A llama.cpp phi3 GGUF (the family's ``gguf`` loader)."""
    return family().loader("gguf").load(path, options)


def load_hf(path: Path, options: LoadOptions) -> LoadedModel:
    """A Phi3ForCausalLM Hugging Face folder (the family's ``hf`` loader)."""
    return family().loader("hf").load(path, options)


def family() -> ModelFamily:
    from llmcore_llama import decoder_family

    return decoder_family(
        name="phi",
        description="Phi-3 and Phi-4-mini decoders (fused projections, LongRoPE, partial rotary)",
        configs=_configs,
        config_descriptions=CONFIG_DESCRIPTIONS,
        default_config="phi4-mini-tiny",
        hf_model_types=MODEL_TYPES,
        hf_architecture=lambda model_type: hf_architecture(),
        hf_description="Hugging Face Phi3ForCausalLM folder (Phi-3, Phi-3.5-mini, Phi-4-mini): config.json + "
        "*.safetensors (sharded too) + tokenizer.json and its chat template",
        gguf_architecture=gguf_architecture,
        gguf_description="GGUF file of llama.cpp's phi3 architecture (the llama plugin's GGUF types; the file's "
        "integers are kept by --quantize gguf) with its embedded tokenizer",
    )


@hookimpl
def llmcore_model_families() -> list[ModelFamily]:
    return [family()]
