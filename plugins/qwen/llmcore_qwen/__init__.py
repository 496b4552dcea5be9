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
from llmcore.records import CheckpointLoader, LoadedModel, LoadOptions, ModelFamily

__version__ = "0.1.0"
__all__ = ["llmcore_model_families", "family", "CONFIGS", "hf_architectures"]

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


def build_random(config: str, options: LoadOptions) -> LoadedModel:
    from llmcore_llama import random_decoder
    from llmcore_llama.loaders import load_error

    configs = _configs()
    if config not in configs:
        raise load_error(f"unknown qwen config {config!r}.", fix=f"choose one of: {', '.join(configs)}.", plugin="qwen")
    return random_decoder(configs[config], options, family="qwen", name=config, tiny=config.endswith("-tiny"))


# llama.cpp's names for the architectures (general.architecture), as config.json's model_type
GGUF_ARCHITECTURES = MODEL_TYPES


def gguf_architecture():
    """The llama plugin's :class:`~llmcore_llama.loaders.GGUFArchitecture` for Qwen GGUFs:
    llama.cpp's converter keeps their q/k rows in Hugging Face's rotate-half order."""
    from llmcore_llama.loaders import GGUFArchitecture

    from . import keys

    return GGUFArchitecture(keys.PLUGIN, GGUF_ARCHITECTURES, rotate_half=True)


def _is_qwen_gguf(path: Path) -> bool:
    from llmcore_llama import formats

    return formats.gguf_architecture(Path(path)) in GGUF_ARCHITECTURES


def load_gguf(path: Path, options: LoadOptions) -> LoadedModel:
    from llmcore_llama import loaders

    return loaders.load_gguf(Path(path), options, gguf_architecture())


def _is_qwen_hf(path: Path) -> bool:
    from llmcore_llama import formats

    return formats.hf_architecture(Path(path)) in MODEL_TYPES


def load_hf(path: Path, options: LoadOptions) -> LoadedModel:
    from llmcore_llama import formats, loaders

    model_type = formats.hf_architecture(Path(path))
    arch = hf_architectures().get(model_type)
    if arch is None:
        raise loaders.load_error(
            f"{path} is a {model_type or 'unrecognised'} checkpoint, not Qwen2/2.5 or Qwen3.",
            fix="leave out --model so that llmcore picks the family from config.json, or pass the right one.",
            plugin="qwen",
        )
    return loaders.load_hf(Path(path), options, arch)


LOADERS = (
    CheckpointLoader(
        name="gguf",
        description="GGUF file of llama.cpp's qwen2 or qwen3 architecture (the llama plugin's GGUF types; the "
        "file's integers are kept by --quantize gguf) with its embedded tokenizer",
        matches=_is_qwen_gguf,
        load=load_gguf,
        claims=_is_qwen_gguf,
    ),
    CheckpointLoader(
        name="hf",
        description="Hugging Face Qwen2ForCausalLM / Qwen3ForCausalLM folder: config.json + *.safetensors "
        "(sharded too) + tokenizer.json and its chat template",
        matches=_is_qwen_hf,
        load=load_hf,
        claims=_is_qwen_hf,
    ),
)


def family() -> ModelFamily:
    return ModelFamily(
        name="qwen",
        description="Qwen2, Qwen2.5 and Qwen3 decoders (the Llama decoder with q/k/v biases or per-head q/k norms)",
        configs=dict(CONFIG_DESCRIPTIONS),
        build_random=build_random,
        loaders=LOADERS,
        default_config="qwen3-tiny",
    )


@hookimpl
def llmcore_model_families() -> list[ModelFamily]:
    return [family()]
