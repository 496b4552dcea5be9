"""Stage 1: resolve the model family and load weights (a checkpoint, or random init)."""

from __future__ import annotations

from pathlib import Path

from llmcore.errors import LlmcoreError, stage_errors
from llmcore.plugins import Registry
from llmcore.recipe import ExportOptions
from llmcore.records import LoadedModel, LoadOptions, ModelFamily


def load_model(options: ExportOptions, registry: Registry) -> LoadedModel:
    provided = registry.get("model_families", options.model, stage="load")
    family: ModelFamily = provided.record
    plugin = provided.plugin.name
    load_options = LoadOptions(
        config=options.config,
        tokenizer_path=Path(options.tokenizer) if options.tokenizer else None,
        max_seq_len=options.max_seq_len,
        seed=options.seed,
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
