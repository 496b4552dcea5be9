"""llmcore-qwen: the Qwen2, Qwen2.5 and Qwen3 model families.

Qwen2/2.5 and Qwen3 are the Llama decoder with a few switches on (q/k/v biases; per-head
q/k norms and biases on every attention projection), so this plugin composes the llama
plugin's decoder, HF loader and config-key rules (:mod:`llmcore_llama`) instead of copying
them: what it adds is which checkpoints are Qwen, which keys they carry (:mod:`.keys`) and
random configurations for tests.

The hook only describes the family; torch and the loaders are imported when a factory runs.
"""

from __future__ import annotations

from pathlib import Path

from llmcore.hookspecs import hookimpl
from llmcore.records import LoadedModel, LoadOptions, ModelFamily

__version__ = "0.1.0"
__all__ = ["llmcore_model_families", "family", "hf_architectures", "gguf_architecture", "load_hf", "load_gguf"]

MODEL_TYPES = ("qwen2", "qwen3")


def _configs() -> dict:
    from llmcore_llama.config import LlamaConfig

    tiny = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, hidden_dim=192, norm_eps=1e-6,
                rope_theta=1000000.0, max_seq_len=128, tie_embeddings=True)
    # SmolLM2-135M's shape with each family's switches: for export timings next to llama's.
    smol = dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, hidden_dim=1536, norm_eps=1e-6,
                rope_theta=1000000.0, max_seq_len=8192, tie_embeddings=True)
    return {
        "qwen2-tiny": LlamaConfig(**tiny, qkv_bias=True),
        "qwen3-tiny": LlamaConfig(**{**tiny, "n_heads": 4, "n_kv_heads": 2}, head_dim=32, qk_norm=True),
        "qwen2-135m": LlamaConfig(**smol, qkv_bias=True),
        "qwen3-135m": LlamaConfig(**smol, head_dim=64, qk_norm=True),
    }


CONFIG_DESCRIPTIONS = {
    "qwen2-tiny": "Qwen2 layout (q/k/v biases), dim 64, 2 layers, 4/2 heads, vocab 320 (byte-level BPE), tied",
    "qwen3-tiny": "Qwen3 layout (q/k norms), dim 64, head_dim 32 (not dim/heads), 2 layers, 4/2 heads, vocab 320, tied",
    "qwen2-135m": "SmolLM2-135M's shape (dim 576, 30 layers, 9/3 heads, ffn 1536, vocab 49152) with q/k/v biases",
    "qwen3-135m": "SmolLM2-135M's shape with Qwen3's q/k norms, head_dim 64",
}


def hf_architectures() -> dict:
    """model_type -> the llama plugin's :class:`~llmcore_llama.loaders.HFArchitecture` for it."""
    from llmcore_llama.loaders import HFArchitecture

    from . import keys

    def sliding(cfg) -> dict:
        window, layers = keys.sliding_window_layers(cfg)
        return {"sliding_window": window, "sliding_layers": tuple(layers)} if window else {}

    def qwen2(cfg, max_seq_len: int) -> dict:
        return {"qkv_bias": True, **sliding(cfg)}

    def qwen3(cfg, max_seq_len: int) -> dict:
        bias = bool(cfg.get("attention_bias") or False)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, **sliding(cfg)}

    return {
        "qwen2": HFArchitecture(keys.PLUGIN, ("qwen2",), ("Qwen2ForCausalLM",), keys.QWEN2_KEYS, qwen2),
        "qwen3": HFArchitecture(keys.PLUGIN, ("qwen3",), ("Qwen3ForCausalLM",), keys.QWEN3_KEYS, qwen3),
    }


def gguf_architecture():
    """The llama plugin's :class:`~llmcore_llama.loaders.GGUFArchitecture` for Qwen GGUFs
    (``general.architecture`` qwen2 / qwen3): llama.cpp's converter keeps their q/k rows in
    Hugging Face's rotate-half order."""
    from llmcore_llama.loaders import GGUFArchitecture

    from . import keys

    return GGUFArchitecture(keys.PLUGIN, MODEL_TYPES, rotate_half=True)


def load_hf(path: Path, options: LoadOptions) -> LoadedModel:
    """A Qwen2/Qwen3 Hugging Face folder (the family's ``hf`` loader)."""
    return family().loader("hf").load(path, options)


def load_gguf(path: Path, options: LoadOptions) -> LoadedModel:
    """A llama.cpp qwen2/qwen3 GGUF (the family's ``gguf`` loader)."""
    return family().loader("gguf").load(path, options)


def family() -> ModelFamily:
    from llmcore_llama import decoder_family

    return decoder_family(
        name="qwen",
        description="Qwen2, Qwen2.5 and Qwen3 decoders (the Llama decoder with q/k/v biases or per-head q/k norms)",
        configs=_configs,
        config_descriptions=CONFIG_DESCRIPTIONS,
        default_config="qwen3-tiny",
        hf_model_types=MODEL_TYPES,
        hf_architecture=lambda model_type: hf_architectures()[model_type],
        hf_description="Hugging Face Qwen2ForCausalLM / Qwen3ForCausalLM folder: config.json + *.safetensors "
        "(sharded too) + tokenizer.json and its chat template",
        gguf_architecture=gguf_architecture,
        gguf_description="GGUF file of llama.cpp's qwen2 or qwen3 architecture (the llama plugin's GGUF types; the "
        "file's integers are kept by --quantize gguf) with its embedded tokenizer",
    )


@hookimpl
def llmcore_model_families() -> list[ModelFamily]:
    return [family()]
