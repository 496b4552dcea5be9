"""Stage 1: resolve the model family and load weights (a checkpoint, or random init)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from llmcore import nesting
from llmcore.errors import LlmcoreError, stage_errors
from llmcore.plugins import Registry
from llmcore.recipe import ExportOptions
from llmcore.records import LoadedModel, LoadOptions, ModelFamily


def _recipe_keeps_integers(quantize: Optional[str], registry: Registry) -> bool:
    """Whether the export wants a quantized checkpoint's own integers: with no ``--quantize``
    (the checkpoint's integers choose the recipe) or a recipe that carries them."""
    from llmcore.pipeline.quantize import NO_RECIPE

    if quantize is None:
        return True
    if quantize == NO_RECIPE or quantize not in registry.names("quantizers"):
        return False  # an unknown name fails with its own message, before load
    return bool(registry.get("quantizers", quantize, stage="quantize").record.for_quantized_checkpoints)


def load_model(options: ExportOptions, registry: Registry) -> LoadedModel:
    provided = registry.get("model_families", options.model, stage="load")
    family: ModelFamily = provided.record
    plugin = provided.plugin.name
    load_options = LoadOptions(
        config=options.config,
        tokenizer_path=Path(options.tokenizer) if options.tokenizer else None,
        max_seq_len=options.max_seq_len,
        seed=options.seed,
        stored_integers=_recipe_keeps_integers(options.quantize, registry),
    )
    if options.tokenizer and not Path(options.tokenizer).exists():
        raise LlmcoreError(
            f"tokenizer {options.tokenizer!r} does not exist.",
            stage="load",
            plugin=plugin,
            fix="pass --tokenizer with the path of the tokenizer files.",
        )
    if options.checkpoint:
        loaded = _load_checkpoint(family, plugin, Path(options.checkpoint), load_options)
    else:
        config = options.config or family.default_config
        if config not in family.configs:
            choices = ", ".join(family.configs) or "(none)"
            raise LlmcoreError(
                f"model family {family.name!r} has no config {config!r}."
                if config
                else f"model family {family.name!r} needs --config or --checkpoint.",
                stage="load",
                plugin=plugin,
                fix=f"pass --config with one of: {choices}; or --checkpoint PATH.",
            )
        loaded = _call(plugin, lambda: family.build_random(config, load_options))
        loaded.source = f"random:{config}"
    loaded.family = family.name
    if loaded.stored_weights:
        from llmcore import stored

        stored.attach(loaded.module, loaded.stored_weights)  # they travel with the tensors from here
    return loaded


def _load_checkpoint(family: ModelFamily, plugin: str, path: Path, options: LoadOptions) -> LoadedModel:
    if not path.exists():
        raise LlmcoreError(
            f"checkpoint {str(path)!r} does not exist.",
            stage="load",
            plugin=plugin,
            fix="check the path given to --checkpoint.",
        )
    for loader in family.loaders:
        if _call(plugin, lambda: loader.matches(path)):
            loaded = _call(plugin, lambda: loader.load(path, options))
            loaded.source = str(path)
            return loaded
    formats = "; ".join(f"{l.name} ({l.description})" for l in family.loaders) or "none"
    raise LlmcoreError(
        f"no loader of model family {family.name!r} recognises {str(path)!r}.",
        stage="load",
        plugin=plugin,
        fix=f"pass a checkpoint in one of the formats it reads: {formats}.",
    )


def _call(plugin: str, fn):
    """Run plugin code; anything but an LlmcoreError becomes one that names the plugin."""
    fix = "check that the checkpoint and config belong to this model family (--debug shows the traceback)."
    with stage_errors("load", plugin, "loading failed", fix):
        return fn()


# The plugin that reads each architecture llmcore knows of, for the message when no
# installed family claims a checkpoint (a config.json model_type, a GGUF architecture).
KNOWN_ARCHITECTURES = {
    "llama": "llmcore-llama",
    "qwen2": "llmcore-qwen",
    "qwen3": "llmcore-qwen",
    "phi3": "llmcore-phi",
    "mistral": "llmcore-mistral",
    "gemma": "llmcore-gemma",
    "gemma2": "llmcore-gemma",
    "gemma3_text": "llmcore-gemma",
    "gemma3": "llmcore-gemma",  # a GGUF's general.architecture
    "gpt2": "llmcore-nanogpt",
}


def detect_family(checkpoint: Path, registry: Registry) -> str:
    """The installed model family whose loaders claim ``checkpoint`` (``export`` without
    ``--model``); one line naming what to install or pass when none or several do."""
    if not checkpoint.exists():
        raise LlmcoreError(
            f"checkpoint {str(checkpoint)!r} does not exist.", stage="load", fix="check the path given to --checkpoint."
        )
    claimed = []
    for provided in registry.all("model_families"):
        family: ModelFamily = provided.record
        for loader in family.loaders:
            if loader.claims is not None and _call(provided.plugin.name, lambda: loader.claims(checkpoint)):
                claimed.append(family.name)
                break
    if len(claimed) == 1:
        return claimed[0]
    installed = ", ".join(registry.names("model_families")) or "(none)"
    if claimed:
        raise LlmcoreError(
            f"model families {', '.join(claimed)} all claim {str(checkpoint)!r}.",
            stage="load",
            fix=f"pass --model with the one to use ({', '.join(claimed)}).",
        )
    arch = architecture_of(checkpoint)
    plugin = KNOWN_ARCHITECTURES.get(arch or "")
    if plugin:
        fix = f"install the plugin that reads it (pip install {plugin}, or -e plugins/... from a clone)."
    else:
        fix = f"pass --model with the family that reads it (installed: {installed}), or install its plugin."
    what = f"a {arch} checkpoint" if arch else "a checkpoint whose architecture it cannot tell"
    raise LlmcoreError(
        f"no installed model family recognises {str(checkpoint)!r} ({what}; installed families: {installed}).",
        stage="load",
        fix=fix,
    )


def architecture_of(checkpoint: Path) -> Optional[str]:
    """What a checkpoint says it is: config.json's ``model_type`` or a GGUF's
    ``general.architecture`` (when the ``gguf`` package is installed); None otherwise."""
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    config = folder / "config.json"
    if config.is_file():
        try:
            model_type = nesting.loads(config.read_text(), what=f"config.json {str(config)!r}").get("model_type")
            return model_type if isinstance(model_type, str) else None
        except (OSError, ValueError, AttributeError):
            return None
    if checkpoint.is_file():
        try:
            with open(checkpoint, "rb") as f:
                if f.read(4) != b"GGUF":
                    return None
            from gguf import GGUFReader

            field = GGUFReader(str(checkpoint)).get_field("general.architecture")
            return field.contents() if field is not None else None
        except Exception:  # any damage: the message just says less
            return None
    return None
