"""The export pipeline, one module per stage, in the order data flows:

load -> transform -> (source quantize) -> capture -> (pt2e quantize, capture again)
-> lower -> post-passes -> emit -> parity -> write -> report

Nothing here names a backend or a model family: those come from plugins, through the
:class:`~llmcore.plugins.Registry`.
"""

from __future__ import annotations

import dataclasses
import gc
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from llmcore import __version__
from llmcore.errors import LlmcoreError
from llmcore.pipeline import capture, emit, lower, parity, quantize, report, transform, write
from llmcore.pipeline.load import detect_family, load_model
from llmcore.plugins import Registry, load_registry
from llmcore.progress import StageLog, limit_heap_fragmentation, remembered_interrupts
from llmcore.recipe import ExportOptions
from llmcore.records import ModelMetadata, TransformContext
from llmcore.runtime import libraries
from llmcore.runtime.chat_template import CONFIG_FILE as TOKENIZER_CONFIG_FILE, template_source, tokenizer_config
from llmcore.runtime.generate import TOKENIZER_FILE, TextTokenizer


# Programs get at most this many positions unless --max-seq-len asks for more: a KV cache
# is sized by it, and most on-device prompts fit.
DEFAULT_MAX_SEQ_LEN = 2048


@dataclass
class ExportResult:
    pte: Path
    report_path: Path
    tokenizer_path: Path
    report: dict[str, Any]


def export(options: ExportOptions, registry: Optional[Registry] = None) -> ExportResult:
    """Run the whole pipeline; writes the `.pte`, its report and the tokenizer, or nothing."""
    with remembered_interrupts(), _collector_for_export(), capture.source_lines(bool(options.etrecord)):
        return _export(options, registry)


# The cycle collector's first threshold during an export (Python's default: 700). Tracing
# and lowering allocate and drop millions of graph objects; at 700, SmolLM2-135M's 8da4w
# export made 3,811 young, 344 middle and 18 full collections on its own, 2.9 s, besides
# the full collection before each stage. At 50,000: a few dozen young ones and no full one
# of its own, under 1 s; the peak RSS stayed 991 MiB (what it frees is freed a little later).
EXPORT_GC_THRESHOLD = 50_000


@contextmanager
def _collector_for_export() -> Iterator[None]:
    """The cycle collector for the length of an export: the ~300k objects that importing
    torch, torchao and the plugins created kept out of its way, and its automatic passes
    made rarer (:data:`EXPORT_GC_THRESHOLD`).

    The imported objects live as long as the process, yet every full collection walks
    them: the collection before each stage (which frees the last stage's graphs) and the
    ones Python starts itself while tracing; each took ~0.2 s on the 2-core machine.
    ExecuTorch is not imported early to be frozen too: it would add ~47 MiB to the quantize
    stage, where the export peaks. Objects that were alive here and die during the export
    are collected after it, when they are unfrozen."""
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], EXPORT_GC_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def _export(options: ExportOptions, registry: Optional[Registry]) -> ExportResult:
    registry = registry if registry is not None else load_registry()
    limit_heap_fragmentation()
    log = StageLog(quiet=options.quiet)
    output = Path(options.output)
    write.check_writable(output)
    if options.etrecord:
        write.check_folder(Path(options.etrecord), "--etrecord")
    report_path = output.with_name(output.stem + ".report.json")
    tokenizer_path = output.with_name(TOKENIZER_FILE)

    if not options.model:  # the checkpoint names its architecture
        options = dataclasses.replace(options, model=detect_family(Path(options.checkpoint), registry))
    # Resolve every name before the long stages, so a typo fails in a second.
    family_plugin = registry.get("model_families", options.model, stage="load").plugin
    backends = lower.resolve_backends(options.plugins, options.backend_options, registry)
    recipe, recipe_options = quantize.resolve_recipe(
        options.quantize, options.quantize_options, options.plugins, registry
    )
    transforms = transform.select_transforms(options, registry, options.model)
    chat_template = template_source(options.chat_template) if options.chat_template else None

    with log.stage("load"):
        loaded = load_model(options, registry)
    meta = loaded.metadata
    if chat_template is not None:  # --chat-template: recorded in place of the checkpoint's
        meta = loaded.metadata = dataclasses.replace(meta, chat_template=chat_template)
    if options.quantize is None and recipe is None:
        recipe, recipe_options = quantize.default_for_checkpoint(
            loaded.stored_weights, options.plugins, registry, options.quantize_options or {}
        )
        if recipe is not None:
            log.say(
                f"the checkpoint stores quantized weights: recipe {recipe.record.name!r} keeps its integers "
                f"(--quantize none for float weights, or name another recipe)"
            )
    loaded.stored_weights = {}  # the stored forms travel with the weight tensors now
    max_seq_len = options.max_seq_len or min(meta.max_seq_len, DEFAULT_MAX_SEQ_LEN)
    if max_seq_len > meta.max_seq_len:
        raise LlmcoreError(
            f"--max-seq-len {max_seq_len} is beyond what the model supports ({meta.max_seq_len}).",
            stage="load",
            plugin=family_plugin.name,
            fix=f"pass --max-seq-len {meta.max_seq_len} or less.",
        )
    if loaded.tokenizer is None:
        raise LlmcoreError(
            f"model family {options.model!r} found no tokenizer for this checkpoint.",
            stage="load",
            plugin=family_plugin.name,
            fix="pass --tokenizer with the tokenizer files of the checkpoint.",
        )
    tokenizer = TextTokenizer(loaded.tokenizer.json_text, source=loaded.tokenizer.description or "model")
    prompt_ids = _prompt_ids(tokenizer, options.prompt, meta, max_seq_len)

    context = TransformContext(
        metadata=meta, max_seq_len=max_seq_len, family=options.model, backends=tuple(options.plugins)
    )
    with log.stage("transform", collect=False):  # load drops no graph
        applied = transform.apply_transforms(loaded, transforms, context)
    module = loaded.module.eval()
    # tokens per call: the context, unless the cache takes fewer at once (ring buffers)
    call_len = context.max_tokens_per_call or max_seq_len
    prompt_ids = prompt_ids[:call_len]

    if recipe is not None and recipe.record.source_quantize is not None:
        with log.stage("quantize", collect=False):  # the transforms swap modules, no graph
            calibration = quantize.calibration_for(
                lambda text: text_ids(tokenizer, text, meta), max_seq_len, call_len, context.use_kv_cache,
                recipe.record.name,
            )
            module = quantize.quantize_source(module, recipe, recipe_options, calibration)

    inputs = capture.example_inputs(prompt_ids, context.use_kv_cache)
    with log.stage("export", collect=False):  # quantize's float layers went with their last reference
        exported = capture.capture(module, inputs, call_len, context.use_kv_cache, family=options.model)
    reference, reference_name = module, "eager PyTorch"
    if recipe is not None:
        reference_name = f"quantized eager PyTorch ({recipe.record.name})"
    if recipe is not None and recipe.record.pt2e_quantizer is not None:
        with log.stage("quantize"):
            converted = quantize.quantize_graph(exported, recipe, recipe_options, [inputs])
            exported = capture.capture(
                converted, inputs, call_len, context.use_kv_cache,
                family=options.model, what="the quantized model",
            )
        reference = converted
        if recipe.record.parity_reference is not None:
            reference = recipe.record.parity_reference(converted)
            reference_name = f"{reference_name}, as the backend computes it"
        module = loaded.module = None  # the float model: only the quantized one is needed now
    else:
        converted = None

    # The eager model's logits for the parity check, now: then the eager model can go, and
    # lowering, serialisation and the parity run do not hold it beside the program.
    expected = parity.reference_logits(reference, prompt_ids, context.use_kv_cache, parity.written_buffers(exported))
    reference = module = loaded.module = converted = None

    # Custom-operator libraries that the graph calls: in the report, loaded here for the
    # parity check, and named in the program unless every runtime has them (ExecuTorch's
    # own; llmcore/runtime/libraries.py).
    runtime_libs = libraries.libraries_for_operators(libraries.graph_operators(exported), registry)
    methods = metadata_methods(meta, max_seq_len, context)
    declared = [p.record.name for p in runtime_libs if p.record.declared]
    if declared:
        methods[libraries.RUNTIME_LIBRARIES_METHOD] = declared
    with log.stage("lower"):
        edge = lower.lower(exported, backends, methods, repeated=not options.whole_graph_lowering)
        delegation = report.delegation_report(edge)
    exported = None  # from here on, only the lowered program (and the eager reference) are needed
    if options.print_graph:
        from executorch.exir.backend.utils import format_delegated_graph

        print(format_delegated_graph(edge.exported_program().graph_module))

    bundle = write.OutputBundle()
    try:
        etrecord_tmp = None
        edge_copy = None
        if options.etrecord:
            etrecord_tmp = bundle.reserve(Path(options.etrecord))
            edge_copy = emit.copy_for_etrecord(edge)
        passes = emit.select_post_passes(registry, options.plugins)
        lowered = edge
        with log.stage("post-passes"):
            edge = emit.apply_post_passes(edge, passes)
        retraced, lowered = edge is not lowered, None
        with log.stage("emit", collect=retraced):  # a pass that ran left the old program behind
            program = emit.to_executorch(edge, str(etrecord_tmp) if etrecord_tmp else None, edge_copy)
            edge = edge_copy = None
            # Staged now (renamed into place only when everything has passed), written part
            # by part (never joined into one bytes object beside the program that holds the
            # same constants), so that the parity run maps the file.
            staged_pte = bundle.stage(output, program.write_to_file)
            program = None
        pte_bytes = staged_pte.stat().st_size
        with log.stage("parity"):
            for provided in runtime_libs:
                libraries.load_runtime_library(provided, stage="parity")
            result = parity.check_parity(
                str(staged_pte), expected, reference_name,
                runs_on={p.record.runtime_id: p.record.runs_on for p, _ in backends if p.record.runtime_id},
            )
        parity.enforce(result, options.strict_parity)

        data = {
            "llmcore_version": __version__,
            "options": dataclasses.asdict(options),
            "model": {
                "family": loaded.family,
                "plugin": family_plugin.package,
                "source": loaded.source,
                # which tokenizer the family chose (Tokenizer.description), e.g. nanoGPT's meta.pkl
                "tokenizer": tokenizer.source,
                "metadata": dataclasses.asdict(meta) | {"chat_template": bool(meta.chat_template)},
                "max_seq_len": max_seq_len,
            },
            "backends": [
                {"name": p.record.name, "plugin": p.plugin.package, "runtime_id": p.record.runtime_id, "options": o}
                for p, o in backends
            ],
            "transforms": applied,
            "quantization": {"recipe": recipe.record.name, "plugin": recipe.plugin.package, "options": recipe_options}
            if recipe
            else None,
            "post_passes": [p.record.name for p in passes],
            "metadata_methods": methods,
            "runtime_libraries": [_library_entry(p) for p in runtime_libs],
            "delegation": delegation,
            "parity": result.as_dict(),
            "stages": [],
            "outputs": {
                "pte": str(output),
                "pte_bytes": pte_bytes,
                "report": str(report_path),
                "tokenizer": str(tokenizer_path),
                "etrecord": options.etrecord,
            },
        }
        with log.stage("write", collect=False):  # the parity run drops no graph
            bundle.stage(tokenizer_path, tokenizer.json_text)
            bundle.stage(tokenizer_path.with_name(TOKENIZER_CONFIG_FILE), _tokenizer_config(tokenizer, meta))
            data["stages"] = log.as_dicts()
            bundle.stage(report_path, report.to_json(data))
            bundle.commit()
    finally:
        bundle.discard()
    data["stages"] = log.as_dicts()
    return ExportResult(output, report_path, tokenizer_path, data)


def _library_entry(provided) -> dict[str, Any]:
    record = provided.record
    try:
        shared = str(record.shared_library()) if record.shared_library else None
    except LlmcoreError:
        shared = None
    return {
        "name": record.name,
        "plugin": provided.plugin.package,
        "ops": list(record.ops),
        "python_module": record.python_module,
        "shared_library": shared,
    }


def text_ids(tokenizer: TextTokenizer, text: str, meta: ModelMetadata) -> list[int]:
    """The model's tokens for a text: its BOS first where it has one, ids it has no row for dropped."""
    ids = tokenizer.encode(text)
    if meta.n_bos and meta.bos_id >= 0:
        ids = [meta.bos_id] * meta.n_bos + ids
    return [i for i in ids if 0 <= i < meta.vocab_size]


def _prompt_ids(tokenizer: TextTokenizer, prompt: str, meta: ModelMetadata, max_seq_len: int) -> list[int]:
    ids = text_ids(tokenizer, prompt, meta)[: max(1, min(max_seq_len, 64))]
    if len(ids) < 2:
        ids = (ids + [0, 1])[:2]
    return ids


def _tokenizer_config(tokenizer: TextTokenizer, meta: ModelMetadata) -> str:
    def token(i: int):
        return tokenizer.decode([i]) if 0 <= i < tokenizer.vocab_size else None

    eos = token(meta.eos_ids[0]) if meta.eos_ids else None
    return tokenizer_config(meta.chat_template, token(meta.bos_id), eos)


def metadata_methods(meta: ModelMetadata, max_seq_len: int, context: TransformContext) -> dict[str, Any]:
    """The constant methods of ``docs/pte-contract.md``."""
    methods: dict[str, Any] = {
        "get_max_seq_len": context.max_tokens_per_call or max_seq_len,  # tokens per call
        "get_max_context_len": max_seq_len,
        "get_vocab_size": meta.vocab_size,
        "get_bos_id": meta.bos_id,
        "get_n_bos": meta.n_bos,
        "use_kv_cache": context.use_kv_cache,
        "use_sdpa_with_kv_cache": context.use_sdpa_with_kv_cache,
        "enable_dynamic_shape": True,
    }
    if meta.eos_ids:
        methods["get_eos_ids"] = list(meta.eos_ids)
    return methods
