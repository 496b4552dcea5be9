"""The export pipeline, one module per stage, in the order data flows:

plan -> load -> transform -> (source quantize) -> capture -> (pt2e quantize, capture again)
-> lower -> post-passes -> emit -> parity -> write -> report

:class:`Export` runs the stages one at a time over one resolved plan
(:mod:`~llmcore.pipeline.plan`), each a method that leaves its output on the object to
look at or change before the next (ExecuTorch's ``LLMEdgeManager`` in spirit);
:func:`export` runs them all, as ``llmcore export`` and ``llmcore.export()`` do.

Nothing here names a backend or a model family: those come from plugins, through the
:class:`~llmcore.plugins.Registry`, or as objects given to :meth:`Export.quantize` and
:meth:`Export.lower`.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from llmcore import __version__
from llmcore.errors import LlmcoreError
from llmcore.pipeline import capture, emit, lower, parity, quantize, report, take, transform, write
from llmcore.pipeline.load import load_model
from llmcore.pipeline.plan import ExportPlan, backend_recipe_defaults, plan_export
from llmcore.plugins import PluginInfo, Provided, Registry, load_registry
from llmcore.progress import StageLog, interrupts_at_safe_points, limit_heap_fragmentation
from llmcore.recipe import ExportOptions
from llmcore.records import CallingConvention, ModelMetadata, QuantizerRecipe, TransformContext
from llmcore.runtime import libraries
from llmcore.runtime.chat_template import CONFIG_FILE as TOKENIZER_CONFIG_FILE, tokenizer_config
from llmcore.runtime.generate import TOKENIZER_FILE, TextTokenizer


# Programs get at most this many positions unless --max-seq-len asks for more: a KV cache
# is sized by it, and most on-device prompts fit.
DEFAULT_MAX_SEQ_LEN = 2048


@dataclass
class ExportResult:
    """What an export wrote: the program, its report (``report``, also saved as JSON at
    ``report_path``) and the tokenizer next to it."""

    pte: Path
    report_path: Path
    tokenizer_path: Path
    report: dict[str, Any]


def export(options: ExportOptions, registry: Optional[Registry] = None) -> ExportResult:
    """Run the whole pipeline; writes the `.pte`, its report and the tokenizer, or nothing."""
    with _exporting(options):
        return Export(options, registry, _whole=True).save()


@contextmanager
def _exporting(options: ExportOptions) -> Iterator[None]:
    """What an export (or one step of it) runs under: Ctrl-C remembered, the cycle collector
    tuned, and node stacks traced only for an ETRecord."""
    with interrupts_at_safe_points(), _collector_for_export(), capture.source_lines(bool(options.etrecord)):
        yield


# The cycle collector's first threshold during an export (Python's default: 700). Tracing
# and lowering allocate and drop millions of graph objects; at 700 the collector runs
# thousands of young and several full collections of its own during one export, besides the
# full collection before each stage. At 50,000 it runs a few dozen young ones and no full
# one, for the same peak RSS (what it frees is freed a little later). Figures: docs/performance.md, "Measurements behind the code".
EXPORT_GC_THRESHOLD = 50_000


@contextmanager
def _collector_for_export() -> Iterator[None]:
    """The cycle collector for the length of an export: the ~300k objects that importing
    torch, torchao and the plugins created kept out of its way, and its automatic passes
    made rarer (:data:`EXPORT_GC_THRESHOLD`).

    The imported objects live as long as the process, yet every full collection walks
    them: the collection before each stage (which frees the last stage's graphs) and the
    ones Python starts itself while tracing, each a noticeable pause.
    ExecuTorch is not imported early to be frozen too: its objects would then sit in memory
    through the quantize stage, where the export peaks. Objects that were alive here and die during the export
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


# The steps of an export, in order: each runs once, and asking for one runs those before it
# that have not run yet (with what the plan says).
STEPS = ("load", "transform", "source_quantize", "take_modules", "capture", "graph_quantize", "lower",
         "post_passes", "to_executorch", "save")

# How error messages name the code that handed a quantizer or partitioners to Export.
CALLER = PluginInfo(name="caller", entry_point="objects passed to llmcore.pipeline.Export")


class Export:
    """One export, stage by stage, over its resolved :class:`~llmcore.pipeline.plan.ExportPlan`.

    Each method runs a stage and returns the export, so that calls chain; between them its
    output is here to look at or change (a later stage reads these attributes):

    * :meth:`load`: ``loaded`` (the :class:`~llmcore.records.LoadedModel`) and ``module``;
    * :meth:`transform`: ``module`` after the source transforms, ``convention`` (its
      :class:`~llmcore.records.CallingConvention`) and ``applied``;
    * :meth:`quantize`: before :meth:`capture`, a source-level recipe changes ``module``;
      after it, a pt2e recipe gives the quantized ``exported``;
    * :meth:`capture`: ``exported`` (``torch.export``'s ``ExportedProgram``);
    * :meth:`lower`: ``edge`` (ExecuTorch's ``EdgeProgramManager``, delegates in place) and
      ``delegation``;
    * :meth:`post_passes`: ``edge`` after the post-passes;
    * :meth:`to_executorch`: ``program`` (the ``ExecutorchProgramManager``), staged next to
      the output;
    * :meth:`save`: the parity check, then the program, its report and its tokenizer written
      together; returns the :class:`ExportResult`.

    A method whose stages before it have not run runs them first, as the plan says, so that
    ``Export(options).save()`` is the whole export (:func:`export`). A stage runs once; once
    one has failed, the export is over. What a stage's output no longer needs is dropped
    when the next stage has it (``exported`` after :meth:`lower`), as the export keeps its
    memory low. Staged files are removed if the export is dropped before :meth:`save`.
    """

    def __init__(self, options: ExportOptions, registry: Optional[Registry] = None, *, _whole: bool = False):
        self._whole = _whole  # run by export(): everything under one _exporting, nothing kept for looking
        self._next = 0
        self._failed: Optional[str] = None
        self._bundle: Optional[write.OutputBundle] = None
        with self._held(options):
            registry = registry if registry is not None else load_registry()
            limit_heap_fragmentation()
            self.log = StageLog(quiet=options.quiet)
            self.output = Path(options.output)
            write.check_writable(self.output)
            if options.etrecord:
                write.check_folder(Path(options.etrecord), "--etrecord")
            # Every name resolved before the long stages, so a typo fails in a second.
            self.plan: ExportPlan = plan_export(options, registry)
            if self.plan.backends_chosen:
                self.log.say(self.plan.backends_chosen)
        self.options = self.plan.options
        self.backends_chosen = self.plan.backends_chosen  # and what they ask of a recipe chosen at load
        self.report_path = self.output.with_name(self.output.stem + ".report.json")
        self.tokenizer_path = self.output.with_name(TOKENIZER_FILE)
        self.loaded = self.module = self.exported = self.edge = self.program = None
        self.recipe: Optional[Provided] = self.plan.recipe
        self.recipe_options: dict = dict(self.plan.recipe_options)
        self.convention = CallingConvention()
        self.applied: list[str] = []
        self.taken: list[take.Taken] = []
        self.delegation: Optional[dict] = None
        self.result: Optional[ExportResult] = None
        self._converted = self._reference = None
        self._reference_name = "eager PyTorch"
        self._partitioners: Optional[list] = None

    # ---- the stages, as the user calls them ----------------------------------------------

    def load(self) -> "Export":
        """Load the plan's model: ``loaded`` and ``module``."""
        return self._advance("load")

    def transform(self) -> "Export":
        """Apply the plan's source transforms to ``module``."""
        return self._advance("transform")

    def quantize(self, quantizer: Any = None) -> "Export":
        """Quantize: the plan's recipe, or ``quantizer`` in its place (with ``quantize`` left
        out of the options, or ``"none"``).

        ``quantizer`` is a pt2e quantizer (a ``torchao.quantization.pt2e.quantizer.Quantizer``,
        such as ExecuTorch's ``XNNPACKQuantizer``): prepare, calibrate on the example prompt,
        convert, capture again, after :meth:`capture`; or a source-level one before it: a
        torchao config (``quantize_(module, config)``) or a function ``f(module)`` that
        quantizes the eager module (returning it, or None when in place)."""
        if quantizer is None:
            self._advance_through("transform")  # the recipe is known once the model is loaded
            pt2e = self.recipe is not None and self.recipe.record.pt2e_quantizer is not None
            if pt2e or self._next > STEPS.index("source_quantize"):
                return self._advance("graph_quantize")
            return self._advance("source_quantize")
        provided = _passed_quantizer(quantizer)
        self._advance_through("transform")
        if self.recipe is not None:
            raise LlmcoreError(
                f"this export quantizes with recipe {self.recipe.record.name!r} already.",
                stage="quantize",
                fix="leave quantize out of the export's options (or pass 'none') to quantize with your own object.",
            )
        step = "graph_quantize" if provided.record.pt2e_quantizer is not None else "source_quantize"
        return self._advance(step, provided)

    def capture(self) -> "Export":
        """``torch.export`` the module, its sequence length dynamic: ``exported``."""
        return self._advance("capture")

    def lower(self, partitioners: Optional[Sequence[Any]] = None) -> "Export":
        """``to_edge`` and lower with the plan's backends' partitioners, in order: ``edge``.
        ``partitioners``: ExecuTorch partitioner objects to lower with in their place (the
        selected backends' edge settings still apply)."""
        return self._advance("lower", list(partitioners) if partitioners is not None else None)

    def post_passes(self) -> "Export":
        """Run the plan's post-passes on ``edge``."""
        return self._advance("post_passes")

    def to_executorch(self) -> "Export":
        """Serialise ``edge`` into ``program``, staged next to the output."""
        return self._advance("to_executorch")

    def save(self) -> ExportResult:
        """Run the parity check, then write the program, its report and its tokenizer."""
        self._advance("save")
        return self.result

    # ---- running them in order -------------------------------------------------------------

    @contextmanager
    def _held(self, options: ExportOptions) -> Iterator[None]:
        with nullcontext() if self._whole else _exporting(options):
            try:
                yield
            except BaseException as exc:
                self._failed = str(exc) or type(exc).__name__
                if self._bundle is not None:
                    self._bundle.discard()
                raise

    def _advance(self, step: str, *args: Any) -> "Export":
        index = STEPS.index(step)
        if self._failed is not None:
            raise LlmcoreError(f"this export stopped at an error ({self._failed}).", stage="export",
                               fix="start a new export.")
        if index < self._next:
            raise LlmcoreError(f"this export's {step.replace('_', ' ')} step has run already.", stage="export",
                               fix="call each step once, in order (load, transform, quantize, capture, lower, "
                                   "post_passes, to_executorch, save).")
        with self._held(self.options):
            while self._next < index:
                getattr(self, "_" + STEPS[self._next])()
                self._next += 1
            getattr(self, "_" + step)(*args)
            self._next = index + 1
        return self

    def _advance_through(self, step: str) -> None:
        if self._next <= STEPS.index(step):
            self._advance(step)

    # ---- the stages ---------------------------------------------------------------------------

    def _load(self) -> None:
        plan, options, log = self.plan, self.options, self.log
        with log.stage("load"):
            loaded = load_model(plan)
        meta = loaded.metadata
        if plan.chat_template is not None:  # --chat-template: recorded in place of the checkpoint's
            meta = loaded.metadata = dataclasses.replace(meta, chat_template=plan.chat_template)
        if options.quantize is None and self.recipe is None:
            self.recipe, self.recipe_options = quantize.default_for_checkpoint(
                loaded.stored_weights, plan.checkpoint_recipe, options.quantize_options or {}
            )
            if self.recipe is not None:
                log.say(
                    f"the checkpoint stores quantized weights: recipe {self.recipe.record.name!r} keeps its integers "
                    f"(--quantize none for float weights, or name another recipe)"
                )
                self.recipe_options, asked = backend_recipe_defaults(
                    self.recipe, self.recipe_options, options.quantize_options or {}, plan.backends)
                if asked:
                    log.say(asked)
                    self.backends_chosen = "; ".join(filter(None, (self.backends_chosen, asked)))
        loaded.stored_weights = {}  # the stored forms travel with the weight tensors now
        if self.recipe is None or not (self.recipe.record.for_quantized_checkpoints
                                       or self.recipe.record.reads_weights_in_file):
            _read_from_file(loaded.module, "no recipe reads them from the checkpoint", log)
        max_seq_len = options.max_seq_len or min(meta.max_seq_len, DEFAULT_MAX_SEQ_LEN)
        if max_seq_len > meta.max_seq_len:
            raise LlmcoreError(
                f"--max-seq-len {max_seq_len} is beyond what the model supports ({meta.max_seq_len}).",
                stage="load",
                plugin=plan.family.plugin.name,
                fix=f"pass --max-seq-len {meta.max_seq_len} or less.",
            )
        if loaded.tokenizer is None:
            raise LlmcoreError(
                f"model family {options.model!r} found no tokenizer for this checkpoint.",
                stage="load",
                plugin=plan.family.plugin.name,
                fix="pass --tokenizer with the tokenizer files of the checkpoint.",
            )
        self.loaded, self.module, self.metadata, self.max_seq_len = loaded, loaded.module, meta, max_seq_len
        # the model's size as loaded (weights left in the file count too: their parameters are on
        # the meta device), for what needs the float model again (llmcore eval's eager reference)
        self.parameters = sum(p.numel() for p in loaded.module.parameters())
        self.tokenizer = TextTokenizer(loaded.tokenizer.json_text, source=loaded.tokenizer.description or "model")
        self.prompt_ids = _prompt_ids(self.tokenizer, options.prompt, meta, max_seq_len)

    def _transform(self) -> None:
        context = TransformContext(
            metadata=self.metadata, max_seq_len=self.max_seq_len, family=self.plan.family_name,
            backends=self.plan.backend_names, kv_cache_dtype=self.plan.options.kv_cache_dtype,
        )
        self.loaded.module = self.module
        with self.log.stage("transform", collect=False):  # load drops no graph
            self.applied, self.convention = transform.apply_transforms(self.loaded, self.plan.transforms, context)
        self.module = self.loaded.module.eval()
        self.kv_cache = kv_cache_summary(self.module)
        # tokens per call: the context, unless the cache takes fewer at once (ring buffers)
        self.call_len = self.convention.max_tokens_per_call or self.max_seq_len
        self.prompt_ids = self.prompt_ids[: self.call_len]

    def _source_quantize(self, passed: Optional[Provided] = None) -> None:
        if passed is not None:
            self.recipe, self.recipe_options = passed, {}
        recipe = self.recipe
        if recipe is None or recipe.record.source_quantize is None:
            return
        meta, tokenizer = self.metadata, self.tokenizer
        with self.log.stage("quantize", collect=False):  # the transforms swap modules, no graph
            calibration = quantize.calibration_for(
                lambda text: text_ids(tokenizer, text, meta), self.max_seq_len, self.call_len,
                self.convention.use_kv_cache, recipe.record.name,
            )
            self.module = quantize.quantize_source(self.module, recipe, self.recipe_options, calibration)

    def _take_modules(self) -> None:
        """The backends that run parts of the module on their own operators (``--plugins
        kernels,xnnpack``: llmcore's layer kernels) swap those parts in, in the backends' order
        (:mod:`llmcore.pipeline.take`)."""
        if not any(p.record.takes_modules for p, _ in self.plan.backends):
            return
        with self.log.stage("take", collect=False):
            self.taken = take.take_modules(self.module, self.plan.backends)
        for taken in self.taken:
            self.log.say(taken.summary())

    def _capture(self) -> None:
        _read_from_file(self.module, "the recipe left them as floats", self.log)
        self._inputs = capture.example_inputs(self.prompt_ids, self.convention.use_kv_cache)
        with self.log.stage("export", collect=False):  # quantize's float layers went with their last reference
            self.exported = capture.capture(
                self.module, self._inputs, self.call_len, self.convention.use_kv_cache, family=self.plan.family_name
            )
        self._reference = self.module
        if self.recipe is not None:
            self._reference_name = f"quantized eager PyTorch ({self.recipe.record.name})"

    def _graph_quantize(self, passed: Optional[Provided] = None) -> None:
        if passed is not None:
            self.recipe, self.recipe_options = passed, {}
            self._reference_name = f"quantized eager PyTorch ({passed.record.name})"
        recipe = self.recipe
        if recipe is None or recipe.record.pt2e_quantizer is None:
            return
        with self.log.stage("quantize"):
            converted = quantize.quantize_graph(self.exported, recipe, self.recipe_options, [self._inputs])
            self.exported = capture.capture(
                converted, self._inputs, self.call_len, self.convention.use_kv_cache,
                family=self.plan.family_name, what="the quantized model",
            )
        self._reference = self._converted = converted
        if recipe.record.parity_reference is not None:
            self._reference = recipe.record.parity_reference(converted)
            self._reference_name = f"{self._reference_name}, as the backend computes it"
        self.module = self.loaded.module = None  # the float model: only the quantized one is needed now

    def _lower(self, partitioners: Optional[list] = None) -> None:
        plan, options = self.plan, self.options
        # The eager model's logits for the parity check, now: then the eager model can go, and
        # lowering, serialisation and the parity run do not hold it beside the program.
        self._expected = parity.reference_logits(
            self._reference, self.prompt_ids, self.convention.use_kv_cache, parity.written_buffers(self.exported)
        )
        self._reference = self.module = self.loaded.module = self._converted = None
        # Custom-operator libraries that the graph calls: in the report, loaded here for the
        # parity check, and named in the program unless every runtime has them (ExecuTorch's
        # own; llmcore/runtime/libraries.py).
        self._runtime_libs = libraries.libraries_providing(libraries.graph_operators(self.exported), plan.libraries)
        methods = metadata_methods(self.metadata, self.max_seq_len, self.convention)
        declared = [p.record.name for p in self._runtime_libs if p.record.declared]
        if declared:
            methods[libraries.RUNTIME_LIBRARIES_METHOD] = declared
        self._methods = methods
        self._partitioners = partitioners
        with self.log.stage("lower"):
            self.edge = lower.lower(
                self.exported, list(plan.backends), methods, repeated=not options.whole_graph_lowering,
                partitioners=partitioners,
            )
            self.delegation = report.delegation_report(self.edge)
        self.exported = None  # from here on, only the lowered program (and the eager reference) are needed
        if options.print_graph:
            from executorch.exir.backend.utils import format_delegated_graph

            print(format_delegated_graph(self.edge.exported_program().graph_module))

    def _post_passes(self) -> None:
        self._bundle = bundle = write.OutputBundle()
        weakref.finalize(self, bundle.discard)  # an export dropped before save() leaves nothing
        self._etrecord_tmp = self._edge_copy = None
        if self.options.etrecord:
            self._etrecord_tmp = bundle.reserve(Path(self.options.etrecord))
            self._edge_copy = emit.copy_for_etrecord(self.edge)
        lowered = self.edge
        with self.log.stage("post-passes"):
            self.edge = emit.apply_post_passes(self.edge, list(self.plan.post_passes))
        self._retraced, lowered = self.edge is not lowered, None

    def _to_executorch(self) -> None:
        with self.log.stage("emit", collect=self._retraced):  # a pass that ran left the old program behind
            tmp = self._etrecord_tmp
            # an export run whole writes the program at once and keeps no graph: the program's
            # buffers can be the weights' own memory
            program = emit.to_executorch(self.edge, str(tmp) if tmp else None, self._edge_copy,
                                         in_place_constants=self._whole)
            self.edge = self._edge_copy = None
            # Staged now (renamed into place only when everything has passed), written part
            # by part (never joined into one bytes object beside the program that holds the
            # same constants), so that the parity run maps the file.
            self._staged_pte = self._bundle.stage(self.output, program.write_to_file)
            self.program = None if self._whole else program
            program = None

    def _save(self) -> None:
        plan, options, log, bundle = self.plan, self.options, self.log, self._bundle
        self.program = None  # the parity run maps the staged file
        pte_bytes = self._staged_pte.stat().st_size
        try:
            with log.stage("parity"):
                for provided in self._runtime_libs:
                    libraries.load_runtime_library(provided, stage="parity")
                result = parity.check_parity(
                    str(self._staged_pte), self._expected, self._reference_name, runs_on=plan.runs_on
                )
            parity.enforce(result, options.strict_parity)
            data = self._report(result, pte_bytes)
            with log.stage("write", collect=False):  # the parity run drops no graph
                bundle.stage(self.tokenizer_path, self.tokenizer.json_text)
                bundle.stage(self.tokenizer_path.with_name(TOKENIZER_CONFIG_FILE),
                             _tokenizer_config(self.tokenizer, self.metadata))
                data["stages"] = log.as_dicts()
                bundle.stage(self.report_path, report.to_json(data))
                bundle.commit()
        finally:
            bundle.discard()
        data["stages"] = log.as_dicts()
        self.result = ExportResult(self.output, self.report_path, self.tokenizer_path, data)

    def _report(self, result, pte_bytes: int) -> dict[str, Any]:
        plan, options, loaded, meta, recipe = self.plan, self.options, self.loaded, self.metadata, self.recipe
        data = {
            "llmcore_version": __version__,
            "options": dataclasses.asdict(options),
            "model": {
                "family": loaded.family,
                "plugin": plan.family.plugin.package,
                "source": loaded.source,
                # which tokenizer the family chose (Tokenizer.description), e.g. nanoGPT's meta.pkl
                "tokenizer": self.tokenizer.source,
                "metadata": dataclasses.asdict(meta) | {"chat_template": bool(meta.chat_template)},
                "max_seq_len": self.max_seq_len,
                "kv_cache": self.kv_cache,
                "parameters": self.parameters,
            },
            "backends": [
                {"name": p.record.name, "plugin": p.plugin.package, "runtime_id": p.record.runtime_id, "options": o}
                for p, o in plan.backends
            ],
            "backends_chosen": self.backends_chosen,
            "transforms": self.applied,
            "taken": [t.as_dict() for t in self.taken],
            "quantization": {"recipe": recipe.record.name, "plugin": recipe.plugin.package,
                             "options": self.recipe_options}
            if recipe
            else None,
            "post_passes": [p.record.name for p in plan.post_passes],
            "metadata_methods": self._methods,
            "runtime_libraries": [_library_entry(p) for p in self._runtime_libs],
            "delegation": self.delegation,
            "parity": result.as_dict(),
            "stages": [],
            "outputs": {
                "pte": str(self.output),
                "pte_bytes": pte_bytes,
                "report": str(self.report_path),
                "tokenizer": str(self.tokenizer_path),
                "etrecord": options.etrecord,
            },
        }
        if self._partitioners is not None:  # lowered with objects given to lower(), not the backends' own
            data["partitioners"] = [type(p).__name__ for p in self._partitioners]
        return data


def _read_from_file(module: Any, why: str, log: StageLog) -> None:
    """Read as floats the weights the loader left in the checkpoint file (:mod:`llmcore.stored`)
    that the export needs as floats after all, saying how many and why."""
    from llmcore import stored

    names = stored.materialize(module) if module is not None else []
    if names:
        log.say(f"{len(names)} weights read from the checkpoint as floats ({why}): {', '.join(names[:3])}"
                f"{' ...' if len(names) > 3 else ''}")


def _passed_quantizer(quantizer: Any) -> Provided:
    """A quantizer object given to :meth:`Export.quantize`, as the recipe record the quantize
    stage runs: a pt2e ``Quantizer``, a function of the module, or a torchao config."""
    from torchao.quantization.pt2e.quantizer import Quantizer

    description = "passed to llmcore.pipeline.Export.quantize"
    if isinstance(quantizer, Quantizer):
        record = QuantizerRecipe(name=type(quantizer).__name__, description=description,
                                 pt2e_quantizer=lambda options: quantizer)
    elif callable(quantizer):
        record = QuantizerRecipe(name=getattr(quantizer, "__name__", type(quantizer).__name__),
                                 description=description, source_quantize=lambda module, options: quantizer(module))
    else:
        from torchao.quantization import quantize_

        record = QuantizerRecipe(name=type(quantizer).__name__, description=description,
                                 source_quantize=lambda module, options: quantize_(module, quantizer))
    return Provided(record, CALLER)


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


def kv_cache_summary(module) -> Optional[dict[str, Any]]:
    """The KV cache the program keeps: its element type (one for every layer: the transform
    stage refuses a swap to another), and its bytes once every position is filled (every
    buffer of the cached attentions: keys, values, an int8 cache's scales and zero points).
    None: no cache the core made (no cache, or a backend's own)."""
    caches = [m for m in module.modules() if getattr(m, "cache_dtype", None) is not None]
    if not caches:
        return None
    nbytes = sum(b.numel() * b.element_size() for m in caches for b in m.buffers(recurse=False))
    return {"dtype": caches[0].cache_dtype, "layers": len(caches), "bytes": nbytes}


def metadata_methods(meta: ModelMetadata, max_seq_len: int, convention: CallingConvention) -> dict[str, Any]:
    """The constant methods of ``docs/pte-contract.md``."""
    methods: dict[str, Any] = {
        "get_max_seq_len": convention.max_tokens_per_call or max_seq_len,  # tokens per call
        "get_max_context_len": max_seq_len,
        "get_vocab_size": meta.vocab_size,
        "get_bos_id": meta.bos_id,
        "get_n_bos": meta.n_bos,
        "use_kv_cache": convention.use_kv_cache,
        "use_sdpa_with_kv_cache": convention.use_sdpa_with_kv_cache,
        "enable_dynamic_shape": True,
    }
    if meta.eos_ids:
        methods["get_eos_ids"] = list(meta.eos_ids)
    return methods
