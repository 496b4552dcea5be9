"""llmcore-gemma: the Gemma, Gemma 2 and Gemma 3 (text) model families.

The Gemma decoders are the Llama decoder with switches on (:class:`llmcore_llama.config.
LlamaConfig`): embeddings scaled by ``sqrt(hidden_size)``, GeGLU with the tanh GELU, a norm
on each sublayer's output (2, 3), attention scaled by ``query_pre_attn_scalar`` (2, 3),
soft-capped attention scores and logits (2), sliding-window layers alternating with global
ones (2, 3), per-head q/k norms and a RoPE base of their own for the sliding layers (3).
This plugin composes the llama plugin's decoder, HF loader and config-key rules: what it
adds is which checkpoints are Gemma, which keys they carry (:mod:`.keys`), the tensor names
of their four norms per layer, folding Gemma's ``1 + w`` norms into plain RMSNorm weights
at load, and random configurations for tests.

The hook only describes the family; torch and the loaders are imported when a factory runs.
"""

from __future__ import annotations

from pathlib import Path

from llmcore.hookspecs import hookimpl
from llmcore.records import LoadedModel, LoadOptions, ModelFamily

__version__ = "0.1.0"
__all__ = ["llmcore_model_families", "family", "hf_architectures", "gguf_architecture", "load_hf", "load_gguf",
           "fold_norms"]

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
GGUF_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}

# Gemma 2/3 name their four norms per layer differently from Llama's two: Llama's
# post_attention_layernorm is the norm *before* the MLP, Gemma's the one *after* attention.
SANDWICH_NAMES = {
    "post_attention_layernorm.weight": "attention_post_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "ffn_post_norm.weight",
}


def fold_norms(hf: dict, config) -> dict:
    """Gemma's RMSNorms multiply by ``1 + w`` (computed in float32); the decoder's by ``w``.
    Every norm weight (per layer, per head of q/k, final) becomes ``1 + w`` in float32, which
    is what transformers multiplies by, so the fold is exact."""
    import torch

    return {
        name: (1.0 + t.to(torch.float32)) if name.endswith("norm.weight") else t
        for name, t in hf.items()
    }


def _configs() -> dict:
    from llmcore_llama.config import LlamaConfig

    gemma = dict(embedding_multiplier=8.0, ffn_activation="gelu_tanh", tie_embeddings=True, norm_eps=1e-6)
    tiny = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, hidden_dim=192, head_dim=32,
                max_seq_len=128, **gemma)
    # SmolLM2-135M's shape with each Gemma's switches: for export timings next to llama's
    smol = dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, hidden_dim=1536, head_dim=64,
                max_seq_len=4096, **{**gemma, "embedding_multiplier": 24.0})
    gemma2 = dict(sandwich_norms=True, attention_scale=256 ** -0.5, attn_softcap=50.0, final_softcap=30.0)
    gemma3 = dict(sandwich_norms=True, attention_scale=256 ** -0.5, qk_norm=True, rope_theta=1_000_000.0,
                  rope_local_theta=10_000.0)
    return {
        "gemma2-tiny": LlamaConfig(**tiny, **gemma2, sliding_window=16, sliding_layers=(0,)),
        "gemma3-tiny": LlamaConfig(**{**tiny, "n_layers": 3}, **gemma3, sliding_window=16, sliding_layers=(0, 1)),
        "gemma2-135m": LlamaConfig(**smol, **gemma2, sliding_window=256, sliding_layers=tuple(range(0, 30, 2))),
        "gemma3-135m": LlamaConfig(**smol, **gemma3, sliding_window=256,
                                   sliding_layers=tuple(i for i in range(30) if (i + 1) % 6)),
    }


CONFIG_DESCRIPTIONS = {
    "gemma2-tiny": "Gemma 2 layout: dim 64, head_dim 32, 2 layers (a sliding one, window 16, then a global one), "
    "soft-capping, sandwich norms, GeGLU, vocab 320 (byte-level BPE), tied",
    "gemma3-tiny": "Gemma 3 layout: dim 64, head_dim 32, 3 layers (2 sliding with RoPE base 1e4, 1 global with 1e6), "
    "q/k norms, sandwich norms, GeGLU, vocab 320, tied",
    "gemma2-135m": "SmolLM2-135M's shape (dim 576, 30 layers, 9/3 heads, ffn 1536, vocab 49152) with Gemma 2's "
    "switches, every other layer sliding (window 256)",
    "gemma3-135m": "SmolLM2-135M's shape with Gemma 3's switches, 5 of every 6 layers sliding (window 256)",
}


def hf_architectures() -> dict:
    """model_type -> the llama plugin's :class:`~llmcore_llama.loaders.HFArchitecture` for it."""
    from llmcore_llama.loaders import HFArchitecture, hf_layer_names

    from . import keys

    def arch(model_type: str) -> HFArchitecture:
        names = hf_layer_names() if model_type == "gemma" else {**hf_layer_names(), **SANDWICH_NAMES}
        return HFArchitecture(
            keys.PLUGIN, (model_type,), (ARCHITECTURES[model_type],), keys.TABLES[model_type],
            lambda cfg, max_seq_len: keys.switches(cfg, model_type), default_norm_eps=1e-6,
            adapt=fold_norms, layer_names=names,
            rope_source=keys.global_rope if model_type == "gemma3_text" else None,
        )

    return {model_type: arch(model_type) for model_type in MODEL_TYPES}


def gguf_architecture():
    """The llama plugin's :class:`~llmcore_llama.loaders.GGUFArchitecture` for llama.cpp's
    gemma, gemma2 and gemma3 GGUFs: norms already ``1 + w`` (the converter adds the one),
    q/k rows in rotate-half order, the sandwich norms under llama.cpp's names
    (``post_attention_norm``, ``post_ffw_norm``), switches from :func:`keys.gguf_switches`."""
    from llmcore_llama.loaders import GGUFArchitecture, gguf_layer_names

    from . import keys

    names = {**gguf_layer_names(), "post_attention_norm.weight": "attention_post_norm.weight",
             "post_ffw_norm.weight": "ffn_post_norm.weight"}
    return GGUFArchitecture(keys.PLUGIN, GGUF_ARCHITECTURES, rotate_half=True, keys=keys.GGUF_KEYS,
                            switches=keys.gguf_switches, layer_names=names)


def load_gguf(path: Path, options: LoadOptions) -> LoadedModel:
    """A llama.cpp gemma / gemma2 / gemma3 GGUF (the family's ``gguf`` loader)."""
    return family().loader("gguf").load(path, options)


def load_hf(path: Path, options: LoadOptions) -> LoadedModel:
    """A Gemma / Gemma 2 / Gemma 3 (text) Hugging Face folder (the family's ``hf`` loader)."""
    return family().loader("hf").load(path, options)


def family() -> ModelFamily:
    from llmcore_llama import decoder_family

    return decoder_family(
        name="gemma",
        description="Gemma, Gemma 2 and Gemma 3 text decoders (scaled embeddings, GeGLU, sandwich norms, "
        "soft-capping, alternating sliding-window layers with their own RoPE base)",
        configs=_configs,
        config_descriptions=CONFIG_DESCRIPTIONS,
        default_config="gemma3-tiny",
        hf_model_types=MODEL_TYPES,
        hf_architecture=lambda model_type: hf_architectures()[model_type],
        hf_description="Hugging Face GemmaForCausalLM / Gemma2ForCausalLM / Gemma3ForCausalLM folder: config.json + "
        "*.safetensors (sharded too) + tokenizer.json and its chat template",
        gguf_architecture=gguf_architecture,
        gguf_description="GGUF file of llama.cpp's gemma, gemma2 or gemma3 architecture (the llama plugin's GGUF "
        "types; the file's integers are kept by --quantize gguf) with its embedded tokenizer",
    )


@hookimpl
def llmcore_model_families() -> list[ModelFamily]:
    return [family()]
