"""Stage 2: source transforms, module to module, before torch.export.

Which transforms run: every automatic transform (of a selected backend, or of none) that
the user does not skip, plus those the user names with ``--transforms``; each must apply
to the model family, and a chosen transform drops those it ``replaces``. They run in
ascending ``order`` (then name), never in the order plugins registered them.

A KV cache's element type (``--kv-cache-dtype``) changes the program's arithmetic, so it is
never dropped on the way: a type the core does not know, a type other than fp32 without a
KV-cache transform, or a transform that swaps the cache for one that keeps another type
fails the export by name (:func:`check_cache_dtype`, :func:`apply_transforms`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from llmcore import kv_cache
from llmcore.errors import LlmcoreError, choose_one_of, stage_errors
from llmcore.plugins import Provided, Registry
from llmcore.recipe import ExportOptions, meant_for
from llmcore.records import CallingConvention, LoadedModel, SourceTransform, Transformed, TransformContext


def select_transforms(options: ExportOptions, registry: Registry, family: str) -> list[Provided]:
    available = {p.record.name: p for p in registry.all("transforms")}
    chosen: dict[str, Provided] = {}
    for name in options.skip_transforms:
        if name not in available:
            raise choose_one_of("source transform", name, available, stage="transform")
    for provided in available.values():
        t: SourceTransform = provided.record
        wanted = meant_for(t.backends, options.plugins)
        if t.automatic and wanted and _fits_family(t, family) and t.name not in options.skip_transforms:
            chosen[t.name] = provided
    for name in options.transforms:
        if name not in available:
            raise choose_one_of("source transform", name, available, stage="transform")
        provided = registry.get("transforms", name, stage="transform")
        t = provided.record
        if not _fits_family(t, family):
            raise LlmcoreError(
                f"source transform {name!r} applies to model families {', '.join(t.families)}, not {family!r}.",
                stage="transform",
                plugin=provided.plugin.name,
                fix="drop it from --transforms.",
            )
        if not meant_for(t.backends, options.plugins):
            raise LlmcoreError(
                f"source transform {name!r} is meant for backends {', '.join(t.backends)}, "
                f"none of which is selected ({', '.join(options.plugins) or 'portable'}).",
                stage="transform",
                plugin=provided.plugin.name,
                fix=f"add one of {', '.join(t.backends)} to --plugins, or drop the transform.",
            )
        chosen[name] = provided
    for provided in list(chosen.values()):
        for replaced in provided.record.replaces:
            chosen.pop(replaced, None)
    check_cache_dtype(options.kv_cache_dtype, chosen)
    return sorted(chosen.values(), key=lambda p: (p.record.order, p.record.name))


def check_cache_dtype(cache_dtype: str, chosen: dict[str, Provided]) -> None:
    """Refuse a ``--kv-cache-dtype`` the core does not know, or one other than fp32 for an
    export without a KV-cache transform (which would leave no cache to keep it)."""
    if cache_dtype not in kv_cache.CACHE_DTYPES:
        raise choose_one_of("KV cache dtype", cache_dtype, kv_cache.CACHE_DTYPES, stage="transform")
    forms = {form.name for form in kv_cache.FORMS}
    if cache_dtype != kv_cache.DEFAULT_CACHE_DTYPE and not forms & set(chosen):
        raise LlmcoreError(
            f"--kv-cache-dtype {cache_dtype} needs a KV cache, and this export has none "
            f"(neither of the {' / '.join(sorted(forms))} transforms is selected).",
            stage="transform",
            fix="drop --kv-cache-dtype, or keep the kv-cache transform (do not --skip-transforms it).",
        )


def _caches_of(module, cache_dtype: str) -> int:
    """How many cached attentions of ``module`` keep ``cache_dtype``."""
    return sum(getattr(m, "cache_dtype", None) == cache_dtype for m in module.modules())


def _fits_family(t: SourceTransform, family: str) -> bool:
    return not t.families or family in t.families


def apply_transforms(
    loaded: LoadedModel, transforms: Sequence[Provided], context: TransformContext
) -> tuple[list[str], CallingConvention]:
    """Apply transforms in order to ``loaded.module``; returns the names applied and the
    calling convention they leave. A transform that returns a :class:`Transformed` changes
    the convention: the transforms after it are handed a context with the new one."""
    applied = []
    wanted = context.kv_cache_dtype
    caches = 0
    for provided in transforms:
        t: SourceTransform = provided.record
        if t.applies is not None and not t.applies(context):
            continue
        fix = "drop the transform or report it to the plugin's authors (--debug shows the traceback)."
        with stage_errors("transform", provided.plugin.name, f"source transform {t.name!r} failed", fix):
            result = t.apply(loaded.module, context)
        if isinstance(result, Transformed):
            context = dataclasses.replace(context, convention=result.convention)
            result = result.module
        if result is not None:
            loaded.module = result
        applied.append(t.name)
        if wanted != kv_cache.DEFAULT_CACHE_DTYPE:
            now = _caches_of(loaded.module, wanted)
            if now < caches:  # a backend's cache in place of the core's: not of the type asked for
                raise LlmcoreError(
                    f"--kv-cache-dtype {wanted}: source transform {t.name!r} swapped {caches - now} of the "
                    f"{caches} {wanted} KV caches for its own, which keep another type.",
                    stage="transform",
                    plugin=provided.plugin.name,
                    fix="drop --kv-cache-dtype for this backend, or ask its authors for caches of that type.",
                )
            caches = now
    return applied, context.convention
