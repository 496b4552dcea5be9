"""Stage 0: the export's plan, every name resolved once before a model is loaded.

:func:`resolve_plan` turns the options and the registry into an :class:`ExportPlan`: the
model family and the checkpoint format (or random config) it loads, the quantizer recipe,
the backends in the user's order with their checked options, the source transforms and
post-passes that will run, and the upstream patches the stages apply. Each stage takes what
it needs from the plan and looks nothing up in the registry, so that a typo, a recipe
meant for another backend or an ExecuTorch outside a patch's range (:func:`plan_export`)
fails in a second, before the long stages, always with the same message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from llmcore import upstream
from llmcore.errors import LlmcoreError, stage_errors
from llmcore.pipeline import emit, load, lower, quantize, transform
from llmcore.plugins import Provided, Registry
from llmcore.recipe import ExportOptions
from llmcore.records import CheckpointLoader
from llmcore.runtime.chat_template import template_source


@dataclass(frozen=True)
class ExportPlan:
    """One export, resolved: what every stage runs, decided before the first one starts."""

    options: ExportOptions
    """The options, with ``model`` filled in when the checkpoint named its family."""
    family: Provided
    """The :class:`~llmcore.records.ModelFamily` and the plugin that provides it."""
    loader: Optional[CheckpointLoader]
    """The family's loader that reads the checkpoint (its format); None for random weights."""
    config: Optional[str]
    """The random-init config (``--config``, or the family's default); None with a checkpoint."""
    recipe: Optional[Provided]
    """The quantizer recipe ``--quantize`` names; None for ``none`` or no ``--quantize``."""
    recipe_options: Mapping[str, Any]
    """Its options (``--quantize-option``), checked and with the defaults filled in."""
    checkpoint_recipe: "Provided | LlmcoreError | None"
    """Without ``--quantize``: the recipe that carries a quantized checkpoint's own integers
    into the selected backends (the first by name), used when the loaded checkpoint stores
    them (:func:`llmcore.pipeline.quantize.default_for_checkpoint`); the error of a recipe
    name two plugins provide, raised then, when one comes first."""
    backends: tuple[tuple[Provided, dict], ...]
    """Each selected :class:`~llmcore.records.Backend` with its checked options, in the
    order of ``--plugins``: the order their partitioners see the graph."""
    transforms: tuple[Provided, ...]
    """The source transforms that will run, in order."""
    post_passes: tuple[Provided, ...]
    """The post-passes of the selected backends, in order."""
    patches: tuple[str, ...]
    """The :mod:`llmcore.upstream` patches the stages apply: lowering's, emitting's and each
    backend's own (``Backend.upstream_patches``). The shortcuts that apply only to some
    programs (``decomposed_in_one_retrace``, ``fused_edge_passes``) are checked when asked."""
    libraries: tuple[Provided, ...]
    """The installed runtime libraries: the export names (and loads, for its parity check)
    those that provide an operator its graph calls."""
    chat_template: Optional[str]
    """The ``--chat-template`` text to record in place of the checkpoint's, or None."""
    backends_chosen: Optional[str] = None
    """Why the backends are what they are when ``--plugins`` did not name them (the default
    list of a CPU export, :func:`choose_backends`), for the summary and the report."""

    @property
    def family_name(self) -> str:
        return self.family.record.name

    @property
    def backend_names(self) -> tuple[str, ...]:
        return tuple(provided.record.name for provided, _ in self.backends)

    @property
    def keeps_integers(self) -> bool:
        """Whether the export wants a quantized checkpoint's own integers: with no ``--quantize``
        (the checkpoint's integers choose the recipe) or a recipe that carries them."""
        if self.options.quantize is None:
            return True
        return self.recipe is not None and bool(self.recipe.record.for_quantized_checkpoints)

    @property
    def weights_in_file(self) -> bool:
        """Whether the recipe reads weights left in the checkpoint file itself, layer by layer."""
        return self.recipe is not None and bool(self.recipe.record.reads_weights_in_file)

    @property
    def runs_on(self) -> dict[str, str]:
        """Backend id -> where it runs, for the parity check's word on a backend this runtime lacks."""
        return {p.record.runtime_id: p.record.runs_on for p, _ in self.backends if p.record.runtime_id}


def resolve_plan(options: ExportOptions, registry: Registry) -> ExportPlan:
    """Resolve every name of ``options`` against ``registry``, in the order the errors are
    reported: the family (read from the checkpoint when ``--model`` is left out), the
    backends, the recipe, the transforms, the chat template, then what the load stage will
    read (the tokenizer, the checkpoint and the loader of its format, or the random config)."""
    if not options.model:  # the checkpoint names its architecture
        options = dataclasses.replace(options, model=load.detect_family(Path(options.checkpoint), registry))
    options, backends_chosen = choose_backends(options, registry)
    family = registry.get("model_families", options.model, stage="load")
    backends = lower.resolve_backends(options.plugins, options.backend_options, registry)
    recipe, recipe_options = quantize.resolve_recipe(
        options.quantize, options.quantize_options, options.plugins, registry
    )
    recipe_options, asked = backend_recipe_defaults(recipe, recipe_options, options.quantize_options or {}, backends)
    if asked:
        backends_chosen = "; ".join(filter(None, (backends_chosen, asked)))
    transforms = transform.select_transforms(options, registry, options.model)
    chat_template = template_source(options.chat_template) if options.chat_template else None
    loader, config = load.checkpoint_format(options, family)
    return ExportPlan(
        options=options,
        family=family,
        loader=loader,
        config=config,
        recipe=recipe,
        recipe_options=recipe_options,
        checkpoint_recipe=quantize.checkpoint_recipe(options.plugins, registry) if options.quantize is None else None,
        backends=tuple(backends),
        transforms=tuple(transforms),
        post_passes=tuple(emit.select_post_passes(registry, options.plugins)),
        patches=(*lower.LOWERING_PATCHES, *emit.EMIT_PATCHES, *_backend_patches(backends)),
        libraries=tuple(registry.all("runtime_libraries")),
        chat_template=chat_template,
        backends_chosen=backends_chosen,
    )


PORTABLE = "none"
"""``--plugins none``: the portable runtime alone, even for a checkpoint or a recipe."""


def choose_backends(options: ExportOptions, registry: Registry) -> tuple[ExportOptions, Optional[str]]:
    """``options`` with ``plugins`` filled in when the user named none, and why (None when the
    user's list stands). A checkpoint or a quantizer recipe without ``--plugins`` means a
    program for this kind of CPU: the installed backends that ask to be in that list
    (``Backend.default_order``), in their order. Random
    weights without a recipe stay on the portable runtime (what tests of a family's graph
    want), as does ``--plugins none``."""
    if options.plugins == [PORTABLE]:
        return dataclasses.replace(options, plugins=[]), None
    if options.plugins:
        return options, None
    quantized = options.quantize not in (None, "", "none")
    if not (quantized or options.checkpoint):
        return options, None
    ranked = []
    for name in registry.names("backends"):
        try:
            order = registry.get("backends", name, stage="lower").record.default_order
        except LlmcoreError:  # a name two plugins provide: never a default, named only by the user
            continue
        if order is not None:
            ranked.append((order, name))
    chosen = [name for _, name in sorted(ranked)]
    if not chosen:
        return options, None
    why = "a recipe" if quantized else "a checkpoint"
    return dataclasses.replace(options, plugins=chosen), (
        f"no --plugins: {why} exported for this CPU gets {','.join(chosen)} (--plugins names others; "
        f"--plugins {PORTABLE} for the portable runtime alone)")


def backend_recipe_defaults(recipe: Optional[Provided], recipe_options: Mapping[str, Any], given: Mapping[str, Any],
                            backends) -> tuple[Mapping[str, Any], Optional[str]]:
    """The recipe's options with the defaults the first selected backend asks for
    (``Backend.recipe_defaults``) in place of the recipe's own, for options the user did not
    give; and a line saying so (None when nothing changed)."""
    if recipe is None:
        return recipe_options, None
    for provided, _ in backends:
        asked = {k: v for k, v in provided.record.recipe_defaults.get(recipe.record.name, {}).items()
                 if k not in given and recipe_options.get(k) != v}
        if asked:
            settings = ", ".join(f"{k}={v}" for k, v in asked.items())
            return {**recipe_options, **asked}, (
                f"backend {provided.record.name!r} runs recipe {recipe.record.name!r} with {settings} (what it "
                f"asks of the recipe: Backend.recipe_defaults); --quantize-option sets them otherwise")
    return recipe_options, None


def plan_export(options: ExportOptions, registry: Registry) -> ExportPlan:
    """:func:`resolve_plan`, then every patch it lists that is switched on checked against the
    installed ExecuTorch and torch (:func:`llmcore.upstream.check_ranges`): an export on
    releases a patch was not written for stops here, before loading a model."""
    plan = resolve_plan(options, registry)
    upstream.check_ranges(plan.patches)
    return plan


def _backend_patches(backends) -> list[str]:
    names: list[str] = []
    for provided, _ in backends:
        listed = provided.record.upstream_patches
        if listed is None:
            continue
        failed = f"backend {provided.record.name!r} could not list its upstream patches"
        with stage_errors("lower", provided.plugin.name, failed, "check the backend's installation (--debug shows the traceback)."):
            names.extend(patch.name for patch in listed())
    return names
