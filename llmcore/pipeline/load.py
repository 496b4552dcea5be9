"""Stage 1: load the weights the plan names (a checkpoint, or random init).

Also what the plan (:mod:`llmcore.pipeline.plan`) asks of this stage before anything is
loaded: the family a checkpoint names when ``--model`` is left out, and the loader of its
format (or the random config)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from llmcore import nesting
from llmcore.errors import LlmcoreError, stage_errors
from llmcore.plugins import Provided, Registry
from llmcore.recipe import ExportOptions
from llmcore.records import CheckpointLoader, LoadedModel, LoadOptions, ModelFamily

if TYPE_CHECKING:
    from llmcore.pipeline.plan import ExportPlan


def checkpoint_format(options: ExportOptions, provided: Provided) -> tuple[Optional[CheckpointLoader], Optional[str]]:
    """What the load stage will read, checked before anything is loaded (the plan's
    ``loader`` and ``config``): the tokenizer path exists; with a checkpoint, the checkpoint
    exists and the family's first loader that recognises it (its format); without one, the
    random config (``--config``, else the family's default) is one the family has."""
    family: ModelFamily = provided.record
    plugin = provided.plugin.name
    if options.tokenizer and not Path(options.tokenizer).exists():
        raise LlmcoreError(
            f"tokenizer {options.tokenizer!r} does not exist.",
            stage="load",
            plugin=plugin,
            fix="pass --tokenizer with the path of the tokenizer files.",
        )
    if options.checkpoint:
        path = Path(options.checkpoint)
        if not path.exists():
            raise LlmcoreError(
                f"checkpoint {str(path)!r} does not exist.",
                stage="load",
                plugin=plugin,
                fix="check the path given to --checkpoint.",
            )
        for loader in family.loaders:
            if _call(plugin, lambda: loader.matches(path)):
                return loader, None
        formats = "; ".join(f"{l.name} ({l.description})" for l in family.loaders) or "none"
        raise LlmcoreError(
            f"no loader of model family {family.name!r} recognises {str(path)!r}.",
            stage="load",
            plugin=plugin,
            fix=f"pass a checkpoint in one of the formats it reads: {formats}.",
        )
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
    return None, config


def load_model(plan: "ExportPlan", *, floats: bool = False) -> LoadedModel:
    """The plan's model: its checkpoint read by the loader of its format, or its random config
    built. ``floats``: every weight as floats in memory, whatever the plan's recipe would read
    from the file or keep as integers (an fp32 reference: ``llmcore eval``'s, a benchmark's)."""
    family: ModelFamily = plan.family.record
    plugin = plan.family.plugin.name
    options = plan.options
    load_options = LoadOptions(
        config=options.config,
        tokenizer_path=Path(options.tokenizer) if options.tokenizer else None,
        max_seq_len=options.max_seq_len,
        seed=options.seed,
        stored_integers=plan.keeps_integers and not floats,
        weights_in_file=plan.weights_in_file and not floats,
    )
    if plan.loader is not None:
        path = Path(options.checkpoint)
        loaded = _call(plugin, lambda: plan.loader.load(path, load_options))
        loaded.source = str(path)
    else:
        loaded = _call(plugin, lambda: family.build_random(plan.config, load_options))
        loaded.source = f"random:{plan.config}"
    loaded.family = family.name
    if loaded.stored_weights:
        from llmcore import stored

        stored.attach(loaded.module, loaded.stored_weights)  # they travel with the tensors from here
    return loaded


def _call(plugin: str, fn):
    """Run plugin code; anything but an LlmcoreError becomes one that names the plugin."""
    fix = "check that the checkpoint and config belong to this model family (--debug shows the traceback)."
    with stage_errors("load", plugin, "loading failed", fix):
        return fn()


ARCHITECTURES_FILE = Path(__file__).resolve().parent.parent / "data" / "architectures.txt"


@functools.cache
def architecture_catalogue() -> dict[str, str]:
    """Architecture -> the distribution whose plugin reads it, from ``llmcore/data/architectures.txt``.

    Why a data file and only for this: which family reads a checkpoint is decided by the
    installed plugins themselves (their loaders' ``claims``), so the core names no family
    in its code. The table is needed for one message alone, the one an export without
    ``--model`` gives when no installed family claims the checkpoint: the plugin to install
    is by definition not installed, so nothing installed can say it. Kept as data, a new
    family plugin adds a line there, never code to the core; when the plugin it names is
    installed and still claims nothing (an older release), the message says so instead."""
    table = {}
    for line in ARCHITECTURES_FILE.read_text(encoding="utf-8").splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) == 2:
            table[fields[0]] = fields[1]
    return table


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
    plugin = architecture_catalogue().get(arch or "")
    if plugin and plugin in {p.distribution for p in registry.plugins}:
        fix = f"upgrade {plugin}, whose families do not read it yet, or pass --model with the family that reads it."
    elif plugin:
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
