"""llmcore-mistral: the Mistral family (``model_type: mistral``, ``MistralForCausalLM``).

Mistral is the Llama decoder with sliding-window attention on every layer (Mistral-7B-v0.1:
4096; later versions set none) and ``head_dim`` of its own, so this plugin composes the
llama plugin's decoder, HF loader and config-key rules (:mod:`llmcore_llama`). The window
is computed by the decoder's attention (``LlamaConfig.sliding_window``) and kept by the
KV-cache transforms, so generation past the window matches transformers.

GGUF: llama.cpp converts Mistral models to its ``llama`` architecture (without the window),
which the llama plugin reads.
"""

from __future__ import annotations

from pathlib import Path

from llmcore.hookspecs import hookimpl
from llmcore.records import LoadedModel, LoadOptions, ModelFamily

__version__ = "0.1.0"
__all__ = ["llmcore_model_families", "family", "load_hf", "hf_architecture"]

PLUGIN = "mistral"
MODEL_TYPES = ("mistral",)


def _keys() -> dict:
    from llmcore_llama.keys import HARMLESS, HF_KEYS, IMPLEMENTED, Key

    return {
        **HF_KEYS,
        "model_type": Key(HARMLESS, "checked: must be mistral"),
        "architectures": Key(HARMLESS, "checked: MistralForCausalLM"),
        "sliding_window": Key(IMPLEMENTED, "a sliding window on every layer (null: none)"),
        "attention_bias": Key(HARMLESS, "not read by transformers' Mistral, which has no biases"),
    }


def hf_architecture():
    """The llama plugin's :class:`~llmcore_llama.loaders.HFArchitecture` for Mistral."""
    from llmcore_llama.keys import sliding_window
    from llmcore_llama.loaders import HFArchitecture

    def switches(cfg, max_seq_len: int) -> dict:  # one window for every layer, or none
        window = sliding_window(cfg.get("sliding_window"), plugin=PLUGIN)
        return {"sliding_window": window} if window else {}

    return HFArchitecture(PLUGIN, MODEL_TYPES, ("MistralForCausalLM",), _keys(), switches)


def _configs() -> dict:
    from llmcore_llama.config import LlamaConfig

    return {
        "mistral-tiny": LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, hidden_dim=192,
                                    norm_eps=1e-5, rope_theta=10000.0, max_seq_len=128, sliding_window=32),
        # SmolLM2-135M's shape with a 256-position window on every layer: export timings next to llama's
        "mistral-135m": LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, hidden_dim=1536,
                                    norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096, tie_embeddings=True,
                                    sliding_window=256),
    }


CONFIG_DESCRIPTIONS = {
    "mistral-tiny": "dim 64, 2 layers, 4/2 heads, sliding window 32 on every layer, vocab 320 (byte-level BPE)",
    "mistral-135m": "SmolLM2-135M's shape (dim 576, 30 layers, 9/3 heads, ffn 1536, vocab 49152) with a 256-position "
    "sliding window",
}


def load_hf(path: Path, options: LoadOptions) -> LoadedModel:
    """A MistralForCausalLM Hugging Face folder (the family's ``hf`` loader)."""
    return family().loader("hf").load(path, options)


def family() -> ModelFamily:
    from llmcore_llama import decoder_family

    return decoder_family(
        name=PLUGIN,
        description="Mistral decoders (the Llama decoder with sliding-window attention)",
        configs=_configs,
        config_descriptions=CONFIG_DESCRIPTIONS,
        default_config="mistral-tiny",
        hf_model_types=MODEL_TYPES,
        hf_architecture=lambda model_type: hf_architecture(),
        hf_description="Hugging Face MistralForCausalLM folder: config.json + *.safetensors (sharded too) + "
        "tokenizer.json and its chat template",
    )


@hookimpl
def llmcore_model_families() -> list[ModelFamily]:
    return [family()]
