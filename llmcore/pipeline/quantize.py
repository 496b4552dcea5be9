"""Stage 4: quantize, at source level (torchao) or on the exported graph (pt2e).

pt2e recipes: prepare -> calibrate on the example prompt -> convert -> the recipe's
``after_convert`` -> export again. The converted module is also the eager reference of the
parity check, so a quantized export is compared with its quantized eager twin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from llmcore.builtins.kv_cache import caches_in_fp32
from llmcore.errors import LlmcoreError, read_text_file, stage_errors
from llmcore.pipeline.parity import buffers_restored
from llmcore.plugins import Provided, Registry
from llmcore.progress import TEMPORARIES_THRESHOLD, heap_for_temporaries, stop_if_interrupted
from llmcore.recipe import check_plugin_options, meant_for
from llmcore.runtime import captured_stderr
from llmcore.records import Calibration, QuantizerRecipe
from llmcore.stored import any_in_file, pass_temporaries, read_while_running


def resolve_recipe(name: Optional[str], options: dict, backends: list[str], registry: Registry):
    """The recipe and its checked options; refuses recipes not meant for the backends.

    ``none`` (or no name) means no recipe; for a quantized checkpoint, no name lets
    :func:`default_for_checkpoint` choose after loading, from :func:`checkpoint_recipe`."""
    if not name or name == NO_RECIPE:
        if name == NO_RECIPE and options:
            raise LlmcoreError(
                "--quantize none takes no --quantize-option.", stage="quantize", fix="drop the options."
            )
        return None, {}
    provided: Provided = registry.get("quantizers", name, stage="quantize")
    recipe: QuantizerRecipe = provided.record
    if not meant_for(recipe.backends, backends):
        raise LlmcoreError(
            f"quantizer recipe {name!r} is meant for {', '.join(recipe.backends)}, "
            f"not for {', '.join(backends) or 'the portable runtime (--plugins none)'}.",
            stage="quantize",
            plugin=provided.plugin.name,
            fix=f"add {recipe.backends[0]} to --plugins, or choose a recipe for your backends.",
        )
    return provided, check_plugin_options(f"quantizer recipe {name!r}", recipe.options, options, provided.plugin.name)


NO_RECIPE = "none"


def checkpoint_recipe(backends: Sequence[str], registry: Registry) -> "Provided | LlmcoreError | None":
    """The recipe an export without ``--quantize`` uses when its checkpoint stores quantized
    integers: the first by name that carries them (``for_quantized_checkpoints`` and
    ``checkpoint_default``) into one of the selected ``backends``; None when none does. A
    name two plugins provide, met before that one, is returned as its error: raised only if
    the checkpoint does store integers (:func:`default_for_checkpoint`)."""
    for name in registry.names("quantizers"):
        try:
            provided = registry.get("quantizers", name, stage="quantize")
        except LlmcoreError as conflict:
            return conflict
        recipe: QuantizerRecipe = provided.record
        if recipe.for_quantized_checkpoints and recipe.checkpoint_default and set(recipe.backends) & set(backends):
            return provided
    return None


def default_for_checkpoint(stored_weights: dict, candidate: "Provided | LlmcoreError | None", options: dict):
    """For a checkpoint that stores quantized integers and an export without ``--quantize``:
    the plan's ``candidate`` (:func:`checkpoint_recipe`) with ``options``
    (``--quantize-option``) checked against it, or ``(None, {})``. Options with no recipe to
    take them are refused, never dropped."""
    from llmcore.stored import has_integers

    if candidate is not None and any(has_integers(f) for f in stored_weights.values()):
        if isinstance(candidate, LlmcoreError):
            raise candidate
        recipe: QuantizerRecipe = candidate.record
        return candidate, check_plugin_options(
            f"quantizer recipe {recipe.name!r}", recipe.options, options, candidate.plugin.name
        )
    if options:
        raise LlmcoreError(
            f"--quantize-option {', '.join(sorted(options))} given without --quantize, and no recipe applies "
            "by default (the checkpoint stores no quantized integers these backends take as they are).",
            stage="quantize",
            fix="name the recipe the options are for, e.g. --quantize 8da4w.",
        )
    return None, {}


def quantize_source(module: Any, provided: Provided, options: dict, calibration: Calibration) -> Any:
    recipe: QuantizerRecipe = provided.record
    if recipe.calibrated:
        return _run(provided, lambda: recipe.source_quantize(module, options, calibration)) or module
    return _run(provided, lambda: recipe.source_quantize(module, options)) or module


CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "data" / "calibration.txt"
"""llmcore's own calibration text: ~350 words written for it (narrative, dialogue, instructions,
figures, a little code, a chat turn), so that no evaluation text is ever what a recipe was
calibrated on."""
CALIBRATION_CALL_TOKENS = 128
"""Tokens per forward call while calibrating a model with a KV cache."""
CALIBRATION_CALL_TOKENS_IN_FILE = 512
"""The same for a model whose weights are still in the checkpoint file: each call reads every
weight from the file again (:func:`llmcore.stored.read_while_running`), which costs more than
the longer call's logits (a 1B's 461 calibration tokens in one call: 236 MiB of logits, three
reads of its 1.5 G weights fewer, 16 s less; docs/performance.md, "Measurements behind the
code")."""


def calibration_for(
    encode: Callable[[str], list[int]], max_seq_len: int, call_len: int, use_kv_cache: bool, recipe: str
) -> Calibration:
    """The :class:`Calibration` a calibrated source recipe receives: ``encode`` gives the
    model's ids for a text (BOS included), ``max_seq_len`` caps the tokens fed (the cache's
    length), ``call_len`` is the most the model takes per call."""

    def token_ids(path: str) -> list[int]:
        source = Path(path) if path else CALIBRATION_TEXT
        text = read_text_file(
            source, f"the calibration text of quantizer recipe {recipe!r}", "quantize",
            "pass a readable UTF-8 text file as calibration_text, or leave it empty for the built-in text.",
        )
        ids = encode(text)
        if not ids:
            raise LlmcoreError(
                f"quantizer recipe {recipe!r}: the calibration text {str(source)!r} has no tokens.",
                stage="quantize",
                fix="pass a text file with some prose in it (a few hundred words is enough).",
            )
        return ids

    def run(module: Any, ids: list[int]) -> int:
        ids = ids[:max_seq_len] if use_kv_cache else ids[:call_len]  # without a cache: one call from 0
        # With a cache, calls of a few tokens see what one long call would (causal attention
        # over the cache), and each call's logits, [tokens, vocab], stay small: hundreds of
        # tokens in one call held their logits at the quantize stage's peak.
        per_call = CALIBRATION_CALL_TOKENS_IN_FILE if any_in_file(module) else CALIBRATION_CALL_TOKENS
        # a layer's weights read from the file, a call's largest temporaries, reuse the heap's
        # pages from layer to layer: as fresh mappings their page faults were a third of a 1B
        # folder's 8da4w export (docs/performance.md, "Measurements behind the code")
        largest = pass_temporaries(module, TEMPORARIES_THRESHOLD)
        step = min(call_len, per_call) if use_kv_cache else call_len
        # weights the loader left in the file are read by each module as it runs, then let go
        # the float model: a cache of another type (--kv-cache-dtype) keeps fp32 meanwhile
        with buffers_restored(module), torch.no_grad(), captured_stderr(), read_while_running(module), \
                caches_in_fp32(module):
            for start in range(0, len(ids), step):
                stop_if_interrupted()
                tokens = torch.tensor([ids[start:start + step]], dtype=torch.long)
                # the hooks' and searches' temporaries reuse heap pages within a call, and
                # what a call leaves free goes back before the next
                with heap_for_temporaries(largest=largest):
                    if use_kv_cache:
                        module(tokens, torch.tensor([start], dtype=torch.long))
                    else:
                        module(tokens)
        return len(ids)

    return Calibration(token_ids, run)


def quantize_graph(
    exported: torch.export.ExportedProgram,
    provided: Provided,
    options: dict,
    calibration_inputs: list[tuple],
) -> torch.fx.GraphModule:
    """pt2e: prepare, calibrate, convert; returns the converted (quantized eager) module."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    recipe: QuantizerRecipe = provided.record
    quantizer = _run(provided, lambda: recipe.pt2e_quantizer(options))
    prepared = _run(provided, lambda: prepare_pt2e(exported.module(), quantizer))
    # The LLM custom ops log "No temp allocator provided" on every eager call: keep it
    # off the terminal (LLMCORE_DEBUG=1 lets it through).
    with torch.no_grad(), captured_stderr():
        for inputs in calibration_inputs:
            prepared(*inputs)
    converted = _run(provided, lambda: convert_pt2e(prepared))
    if recipe.after_convert is not None:
        _run(provided, lambda: recipe.after_convert(converted))
    return converted


def _run(provided: Provided, fn):
    failed = f"quantizer recipe {provided.record.name!r} failed"
    fix = "try another recipe or its default options (--debug shows the traceback)."
    with stage_errors("quantize", provided.plugin.name, failed, fix):
        return fn()
