"""llmcore-llama: the Llama model family (Llama 2/3, SmolLM2 and other llama-architecture models).

The hook only describes the family; torch, gguf and the loaders are imported when a
factory is called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from llmcore.hookspecs import hookimpl
from llmcore.records import CheckpointLoader, Lazy, LoadedModel, LoadOptions, ModelFamily

from . import formats
from .config import CONFIG_DESCRIPTIONS, CONFIGS

__version__ = "0.1.0"
__all__ = ["llmcore_model_families", "family", "build_random", "random_decoder", "decoder_family", "LOADERS"]


def build_random(config: str, options: LoadOptions) -> LoadedModel:
    """A randomly initialised model of one of :data:`CONFIGS` (seeded by ``options.seed``)."""
    from .loaders import load_error

    if config not in CONFIGS:
        raise load_error(
            f"unknown llama config {config!r}.",
            fix=f"choose one of: {', '.join(sorted(CONFIGS))}.",
        )
    return random_decoder(CONFIGS[config], options, family="llama", name=config, tiny=config == "tiny")


def random_decoder(cfg, options: LoadOptions, *, family: str, name: str, tiny: bool) -> LoadedModel:
    """A randomly initialised decoder of :class:`~llmcore_llama.config.LlamaConfig` ``cfg``
    for model family ``family`` (families built on this decoder share it); ``tiny`` gives
    it the tiny byte-level tokenizer when the user passes none."""
    import torch

    from .loaders import load_error, loaded_model, resolve_dtype, resolve_tokenizer
    from .model import Transformer, init_random
    from .tokenization import tiny_tokenizer

    cfg = cfg.with_max_seq_len(options.max_seq_len)
    dtype = resolve_dtype(options.dtype)
    with torch.device("meta"):  # skip nn.Linear's own (slow) init; init_random fills everything
        model = Transformer(cfg)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    model = init_random(model, seed=options.seed).to(dtype)
    model.reset_buffers()
    model.eval()
    tok = resolve_tokenizer(options)
    if tok is None and tiny:
        tok = tiny_tokenizer(cfg.vocab_size)
    if tok is not None and tok.size > cfg.vocab_size:
        raise load_error(
            f"the tokenizer has {tok.size} tokens but config {name!r} has a vocabulary of {cfg.vocab_size}.",
            fix="pass a tokenizer that fits the config, or none.",
            plugin=family,
        )
    return loaded_model(model, cfg, tok, family=family, source=f"random:{name}")


LOADERS = (
    CheckpointLoader(
        name="gguf",
        description="GGUF file of llama architecture (F32/F16/BF16, Q8_0, Q4_0/1, Q5_0/1, Q4_K/Q5_K/Q6_K) with its embedded tokenizer",
        matches=lambda p: formats.is_gguf(Path(p)),
        load=Lazy("llmcore_llama.loaders", "load_gguf"),
        claims=lambda p: formats.gguf_architecture(Path(p)) == "llama",
    ),
    CheckpointLoader(
        name="hf",
        description="Hugging Face LlamaForCausalLM folder: config.json + *.safetensors (+ tokenizer.json)",
        matches=lambda p: formats.is_hf(Path(p)),
        load=Lazy("llmcore_llama.loaders", "load_hf"),
        claims=lambda p: formats.hf_architecture(Path(p)) == "llama",
    ),
    CheckpointLoader(
        name="meta",
        description="Meta checkpoint: params.json + consolidated.*.pth (+ tokenizer.model), read with weights_only",
        matches=lambda p: formats.is_meta(Path(p)),
        load=Lazy("llmcore_llama.loaders", "load_meta"),
        claims=lambda p: formats.is_meta(Path(p)),  # params.json + consolidated.*.pth: Meta's llama format
    ),
    CheckpointLoader(
        name="llama2c",
        description="llama2.c fp32 checkpoint (.bin, legacy header or version 1)",
        matches=lambda p: formats.is_llama2c(Path(p)),
        load=Lazy("llmcore_llama.loaders", "load_llama2c"),
        claims=lambda p: formats.is_llama2c(Path(p)),
    ),
)


def decoder_family(
    *,
    name: str,
    description: str,
    configs: Callable[[], dict],
    config_descriptions: dict[str, str],
    default_config: str,
    hf_model_types: tuple[str, ...],
    hf_architecture: Callable[[str], object],
    hf_description: str,
    gguf_architecture: Optional[Callable[[], object]] = None,
    gguf_description: str = "",
) -> ModelFamily:
    """The :class:`ModelFamily` of a family that is this decoder with switches on (Qwen,
    Phi-3, Mistral): random configs, and loaders for Hugging Face folders whose config.json
    names one of ``hf_model_types`` (and GGUF files whose ``general.architecture`` is one of
    the GGUF architecture's names), which claim them so that ``--model`` can be left out.

    ``configs()`` gives name -> :class:`~llmcore_llama.config.LlamaConfig`;
    ``hf_architecture(model_type)`` the :class:`~llmcore_llama.loaders.HFArchitecture` for
    a model type and ``gguf_architecture()`` the ``GGUFArchitecture``. They are called when
    a model is built or loaded, so listing plugins imports no torch.
    """

    def build(config: str, options: LoadOptions) -> LoadedModel:
        from .loaders import load_error

        table = configs()
        if config not in table:
            raise load_error(f"unknown {name} config {config!r}.", fix=f"choose one of: {', '.join(table)}.",
                             plugin=name)
        return random_decoder(table[config], options, family=name, name=config, tiny=config.endswith("-tiny"))

    def is_hf(path) -> bool:
        return formats.hf_architecture(Path(path)) in hf_model_types

    def load_hf(path, options: LoadOptions) -> LoadedModel:
        from . import loaders

        model_type = formats.hf_architecture(Path(path))
        # another family's folder gets the first architecture, whose check names both
        arch = hf_architecture(model_type if model_type in hf_model_types else hf_model_types[0])
        return loaders.load_hf(Path(path), options, arch)

    found = [CheckpointLoader(name="hf", description=hf_description, matches=is_hf, load=load_hf, claims=is_hf)]
    if gguf_architecture is not None:

        def is_gguf(path) -> bool:
            return formats.gguf_architecture(Path(path)) in gguf_architecture().names

        def load_gguf(path, options: LoadOptions) -> LoadedModel:
            from . import loaders

            return loaders.load_gguf(Path(path), options, gguf_architecture())

        found.insert(0, CheckpointLoader(name="gguf", description=gguf_description, matches=is_gguf,
                                         load=load_gguf, claims=is_gguf))
    return ModelFamily(
        name=name,
        description=description,
        configs=dict(config_descriptions),
        build_random=build,
        loaders=tuple(found),
        default_config=default_config,
    )


def family() -> ModelFamily:
    return ModelFamily(
        name="llama",
        description="Llama 2/3-style decoder (RMSNorm, RoPE, GQA, SwiGLU): Llama, SmolLM2, TinyLlama, llama2.c stories",
        configs=dict(CONFIG_DESCRIPTIONS),
        build_random=build_random,
        loaders=LOADERS,
        default_config="tiny",
    )


@hookimpl
def llmcore_model_families() -> list[ModelFamily]:
    return [family()]
