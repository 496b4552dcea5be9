"""Typed records that plugins return from their hooks.

Every hook in :mod:`llmcore.hookspecs` returns a list of these dataclasses. They carry
*factories* (plain callables) rather than built objects, so that listing plugins never
imports a heavy backend: ExecuTorch backends, torchao or vendor SDKs are imported only
when a factory is called for an export that uses them. :class:`Lazy` makes such a factory
from a module's and a function's names.
"""

from __future__ import annotations

import importlib
import re
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

from llmcore.errors import LlmcoreError

# --------------------------------------------------------------------------------------
# What every record shares
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """The base of the records hooks return: a ``name`` users type on the command line.

    A name is not empty and has no whitespace or commas (the CLI splits lists such as
    ``--plugins a,b`` on commas). A record with another name refuses to be built, with a
    one-line :class:`~llmcore.errors.LlmcoreError` that names the kind of record; the
    registry adds the plugin whose hook built it and skips that plugin.
    """

    name: str
    kind: ClassVar[str] = "record"
    """What the CLI and error messages call one of these (``backend``, ``post-pass``)."""

    def __post_init__(self) -> None:
        name = self.name
        if isinstance(name, str) and name and not re.search(r"[\s,]", name):
            return
        fixed = re.sub(r"[\s,]+", "-", name.strip()).strip("-") if isinstance(name, str) else ""
        raise LlmcoreError(
            f"{self.kind} name {name!r} is not valid: a name is not empty and has no whitespace or commas "
            "(the CLI splits lists on commas).",
            stage="plugins",
            fix=f"rename it, e.g. {fixed!r}." if fixed else f"give it a name, e.g. 'my-{self.kind.replace(' ', '-')}'.",
        )


# --------------------------------------------------------------------------------------
# Factories
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lazy:
    """A factory that imports ``module`` only when it is called, then calls its ``name`` with the
    same arguments: ``Lazy("llmcore_vulkan.attention", "apply")(module, context)`` is
    ``llmcore_vulkan.attention.apply(module, context)``.

    This exists because a hook must not import what its factories need (torch, ExecuTorch, a
    vendor SDK): listing plugins would pay for every backend. Without it, each plugin wrote a
    two-line function per factory that imported its target and forwarded the call. A factory
    that does more than forward (binds an option, adapts the arguments) stays a function.
    Nothing is imported or checked when a ``Lazy`` is made; a misspelt target fails when it is
    first called, as such a function did (``tests/test_discovery.py`` resolves every
    installed plugin's).
    """

    module: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)


# --------------------------------------------------------------------------------------
# Model families
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelMetadata:
    """Facts about a loaded model that runners need; written into the `.pte`."""

    vocab_size: int
    max_seq_len: int
    """The longest sequence the model supports (its positional range)."""
    bos_id: int = -1
    """Begin-of-sequence token id, or -1 when the tokenizer has none."""
    eos_ids: tuple[int, ...] = ()
    n_bos: int = 0
    """How many BOS tokens a runner puts before a prompt (0 or 1)."""
    chat_template: Optional[str] = None
    """A Jinja chat template for instruct models, when the checkpoint carries one."""


@dataclass
class Tokenizer:
    """A tokenizer in Hugging Face `tokenizer.json` form.

    `json_text` is what llmcore writes next to every `.pte`; runners encode and decode
    with it. Plugins convert whatever their checkpoints ship (vocab.json + merges.txt,
    GGUF metadata, ...) into this one form.
    """

    json_text: str
    description: str = ""


@dataclass
class LoadedModel:
    """What a loader hands to the pipeline: an eager module plus everything around it.

    The module follows the calling convention of `docs/pte-contract.md`:
    `forward(tokens[1, T]) -> logits[1, V]`, and after a KV-cache transform
    `forward(tokens[1, T], input_pos[1]) -> logits[1, V]`.
    """

    module: Any  # torch.nn.Module; typed loosely so importing records needs no torch
    metadata: ModelMetadata
    tokenizer: Optional[Tokenizer] = None
    family: str = ""
    source: str = ""
    """Where the weights came from: a path, or `random:<config>`."""
    stored_weights: dict = field(default_factory=dict)
    """Parameter name -> how the checkpoint stored it (:mod:`llmcore.stored`), for recipes
    that carry a quantized checkpoint's own integers into the program."""


@dataclass(frozen=True)
class CheckpointLoader(Record):
    """One checkpoint format a model family reads.

    `matches(path)` says whether this loader recognises a path (a file or a folder);
    the first loader of the family that matches is used. `load(path, options)` returns
    a :class:`LoadedModel`; it must refuse pickles that execute code.
    """

    kind: ClassVar[str] = "checkpoint loader"
    description: str
    matches: Callable[[Path], bool]
    load: Callable[[Path, "LoadOptions"], LoadedModel]
    claims: Optional[Callable[[Path], bool]] = None
    """Whether the checkpoint's own metadata names this family's architecture (a
    config.json ``model_type``, a GGUF ``general.architecture``): how an export without
    ``--model`` picks the family. ``matches`` only recognises a format that several
    families may share; None: the loader never claims a checkpoint."""


@dataclass(frozen=True)
class LoadOptions:
    """Options a user passes to a loader from the CLI or a recipe."""

    config: Optional[str] = None
    tokenizer_path: Optional[Path] = None
    max_seq_len: Optional[int] = None
    dtype: str = "float32"
    seed: int = 0
    stored_integers: bool = False
    """Whether a loader of quantized checkpoints keeps their integers for a recipe that
    carries them into the program (:attr:`LoadedModel.stored_weights`), set by an export
    whose recipe does (no ``--quantize``, or ``gguf``). A loader may then leave such weights
    in the file (:class:`llmcore.stored.FileWeight`, meta parameters that refuse to run until
    read), so that the export never holds them as floats. False (a float model, as a
    reference, or a recipe that rounds floats it is handed): every weight read as floats."""
    weights_in_file: bool = False
    """Whether a loader may leave any 2-D weight in the file (:class:`llmcore.stored.FileWeight`),
    float ones included, set by an export whose recipe reads them there one layer at a time
    (:attr:`QuantizerRecipe.reads_weights_in_file`). A loader that cannot leave a weight in
    its file (a pickle, a tensor rewritten at load) reads it as before."""


@dataclass(frozen=True)
class ModelFamily(Record):
    """A model architecture and the ways to get weights into it."""

    kind: ClassVar[str] = "model family"
    description: str
    configs: Mapping[str, str]
    """Named configurations for random initialisation: name -> one-line description."""
    build_random: Callable[[str, LoadOptions], LoadedModel]
    """Build a randomly initialised model from one of `configs`."""
    loaders: Sequence[CheckpointLoader] = ()
    default_config: Optional[str] = None

    def loader(self, name: str) -> CheckpointLoader:
        """The loader called ``name`` (KeyError when the family has none)."""
        for found in self.loaders:
            if found.name == name:
                return found
        raise KeyError(f"model family {self.name!r} has no loader {name!r}")


# --------------------------------------------------------------------------------------
# Source transforms
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallingConvention:
    """How the exported program is called (``docs/pte-contract.md``), as the source
    transforms leave it; the program's constant methods of the same names record it.

    The export starts from the plain convention (``forward(tokens)``, no cache). A transform
    that changes it returns the module with the convention from then on (a
    :class:`Transformed`); the transform stage hands it to the next transform in its
    :class:`TransformContext` and the pipeline (capture, calibration, parity, the program's
    metadata) reads the last one. A transform never sets it on the context it was given."""

    use_kv_cache: bool = False
    """The program is ``forward(tokens, input_pos)`` over a cache it keeps in its buffers."""
    use_sdpa_with_kv_cache: bool = False
    """Its cache uses ExecuTorch's fused ``llama::custom_sdpa`` op (runners must load ExecuTorch's
    LLM custom ops)."""
    max_tokens_per_call: Optional[int] = None
    """The most tokens one call takes, when the cache limits it (sliding layers' ring
    buffers): the program's ``get_max_seq_len``, and prompts are fed in chunks of it. None:
    a call may take the whole context (``max_seq_len``)."""


@dataclass(frozen=True)
class Transformed:
    """What a source transform that changes the calling convention returns: the module
    (the one it was given, changed in place, or a new one) and the convention from now on,
    usually ``dataclasses.replace(context.convention, ...)`` of the one it was handed."""

    module: Any
    convention: CallingConvention


@dataclass(frozen=True)
class TransformContext:
    """What a source transform reads: the model, the program's length, the family and
    backends of the export, and the calling convention the transforms before it left
    (:class:`CallingConvention`). Frozen: a transform that changes the convention returns a
    :class:`Transformed` instead of setting anything here."""

    metadata: ModelMetadata
    max_seq_len: int
    """The sequence length the program is exported for."""
    family: str
    backends: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)
    convention: CallingConvention = CallingConvention()
    """The calling convention so far (the plain one before any transform changed it)."""
    kv_cache_dtype: str = "fp32"
    """What a KV cache keeps (``--kv-cache-dtype``, a name of :data:`llmcore.kv_cache.CACHE_DTYPES`)."""

    @property
    def first_backend(self) -> Optional[str]:
        """The backend that gets the graph first (``--plugins``' first name), if any."""
        return self.backends[0] if self.backends else None

    @property
    def use_kv_cache(self) -> bool:
        """``convention.use_kv_cache``: whether a transform before this one added a cache."""
        return self.convention.use_kv_cache

    @property
    def use_sdpa_with_kv_cache(self) -> bool:
        """``convention.use_sdpa_with_kv_cache``."""
        return self.convention.use_sdpa_with_kv_cache

    @property
    def max_tokens_per_call(self) -> Optional[int]:
        """``convention.max_tokens_per_call``."""
        return self.convention.max_tokens_per_call


@dataclass(frozen=True)
class SourceTransform(Record):
    """A named module-to-module rewrite applied before `torch.export`.

    `apply(module, context)` returns the module (or None: changed in place), or a
    :class:`Transformed` when it changes the calling convention (adds a KV cache, or swaps
    one for a form that calls other ops). Transforms run in ascending `order`; ties break by name. `families` and `backends`
    restrict where the transform applies (empty means everywhere). A transform with
    `automatic=True` runs whenever one of its `backends` is selected (or always, when it
    names no backend) unless the user skips it with `--skip-transforms`; others run only
    when the user names them with `--transforms`. A selected transform drops the ones it
    `replaces` (a plain-PyTorch KV cache replacing the custom-op one, say). `applies`,
    when given, is asked once the context is known; a transform it declines is skipped and
    not reported (a rewrite that only helps when its backend gets the graph first).
    """

    kind: ClassVar[str] = "source transform"
    description: str
    apply: Callable[[Any, TransformContext], Any]
    order: int = 100
    families: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    automatic: bool = False
    replaces: tuple[str, ...] = ()
    applies: Optional[Callable[["TransformContext"], bool]] = None


@dataclass(frozen=True)
class KVCacheForm(Record):
    """A cached attention module the core's KV-cache transforms produce: part of the
    extension API, listed (with the classes) by :mod:`llmcore.kv_cache`.

    The ``kv-cache`` and ``kv-cache-static`` source transforms (``order`` 50) swap every
    :class:`llmcore.modules.CausalAttention` for the form of their ``name``. A backend's
    transform that runs after them (a higher ``order``) may find these modules in the model
    it is handed and swap them for its own cached attention, or refuse one it cannot run;
    it relies on what a form declares here and on nothing else of the core's implementation
    (``llmcore.builtins`` is not for plugins).

    Every form is an ``nn.Module`` whose ``forward(q, k, v, input_pos)`` takes ``q`` as
    ``[1, T, n_heads, head_dim]``, ``k`` and ``v`` as ``[1, T, n_kv_heads, head_dim]`` and
    ``input_pos`` as ``[1]`` (the position of the first of the ``T`` tokens), and returns
    ``[1, T, n_heads * head_dim]``, with the attributes in :data:`KV_CACHE_ATTRIBUTES`:
    ``capacity`` (the positions its cache holds: the program's ``max_seq_len``), ``window``
    (a sliding window shorter than ``capacity``, or None), ``slots`` (a sliding layer's ring
    buffer rows, or None: a full-length cache), ``scale`` and ``softcap`` (as
    ``CausalAttention`` has them) and the non-persistent buffers ``k_cache`` and ``v_cache``
    laid out as ``cache_layout`` says (``S``: ``slots`` or ``capacity`` rows), and ``cache_dtype``
    (a name of :data:`llmcore.kv_cache.CACHE_DTYPES`: what the buffers hold, as the user chose
    with ``--kv-cache-dtype``; ``int8`` adds ``k_scales``, ``k_zero_points``, ``v_scales`` and
    ``v_zero_points``, one per position and head). A backend's transform that swaps a cache for
    its own keeps that element type or refuses the export; the export checks that the cache
    the program keeps is of the type asked for.
    """

    kind: ClassVar[str] = "kv-cache form"
    description: str
    module_class: str
    """The form's class, ``"module:Class"`` (:meth:`module_type` imports it; that imports torch)."""
    cache_layout: str
    """The shape of its ``k_cache`` / ``v_cache`` buffers: ``"[1, S, H_kv, D]"``, ``"[S, H_kv, D]"``."""
    custom_ops: tuple[str, ...] = ()
    """The ExecuTorch custom operators its forward calls (``llama::custom_sdpa``, ...); none:
    plain PyTorch operators only. A program with a form that calls ``llama::custom_sdpa`` has
    ``use_sdpa_with_kv_cache`` in its :class:`CallingConvention`; a transform that swaps every
    such module for one that does not returns the convention without it."""

    def module_type(self) -> type:
        """The form's class."""
        module, _, name = self.module_class.partition(":")
        return getattr(importlib.import_module(module), name)


KV_CACHE_ATTRIBUTES = (
    "n_heads", "n_kv_heads", "head_dim", "capacity", "window", "slots", "scale", "softcap", "k_cache", "v_cache",
    "cache_dtype",
)
"""What every :class:`KVCacheForm` module has, for a backend's transform to read."""


# --------------------------------------------------------------------------------------
# Quantizers
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Text to run through the float model before a source recipe quantizes it.

    A recipe that chooses its integers from activations (which input channels carry the
    most energy) needs the model run on real text; the pipeline knows how to call the
    model (chunks, positions, its KV cache), the recipe knows what to record (forward hooks
    on the layers it will replace). ``token_ids(path)`` tokenizes a text file, or llmcore's
    built-in calibration text when ``path`` is empty; ``run(module, ids)`` feeds the ids
    (as many as the model's context takes: it returns that number) through the module
    without gradients and leaves its buffers (the KV cache, which the exported program
    takes as initial values) as they were.
    """

    token_ids: Callable[[str], list[int]]
    run: Callable[[Any, list[int]], int]


@dataclass(frozen=True)
class ScalableChannels:
    """Channels a quantizer may rescale without changing what the float model computes.

    The output channels of ``source`` (a norm: its weight and bias; or a linear: its rows
    and bias) reach the inputs of ``linears`` only through operations that are linear per
    channel, so dividing channel ``j`` at the source by ``s_j`` and multiplying input
    column ``j`` of every one of ``linears`` by ``s_j`` is an identity. A model lists these
    in a ``scalable_channels()`` method; :mod:`llmcore.channel_scales` chooses the scales.

    ``repeats`` and ``head_dim`` describe grouped-query attention, where the values reach the
    output projection as ``[kv_heads, repeats, head_dim]``: every source channel feeds
    ``repeats`` input columns, which share its scale. ``repeats=1``: the same channels.
    Names are relative to the module that lists them.
    """

    source: str
    linears: tuple[str, ...]
    repeats: int = 1
    head_dim: int = 0


@dataclass(frozen=True)
class QuantizerRecipe(Record):
    """A named quantization recipe.

    Exactly one of the two factories is set:

    * `pt2e_quantizer(options)` returns a pt2e `Quantizer`; the pipeline runs
      prepare -> calibrate -> convert on the exported graph, then `after_convert`
      (in place, on the converted GraphModule), then exports again.
    * `source_quantize(module, options)` quantizes the eager module in place before
      export (torchao's `quantize_` with a config, for instance). With `calibrated`, it is
      called as `source_quantize(module, options, calibration)`, a :class:`Calibration`
      that runs text through the float module (for scales chosen from activations).

    `backends` lists the backends the recipe is meant for; empty means any.
    `options` documents the options it accepts: name -> (type, default, help).
    `for_quantized_checkpoints`: the recipe carries a quantized checkpoint's own integers
    (:mod:`llmcore.stored`); an export of such a checkpoint without ``--quantize`` uses it
    when one of its backends is selected (``--quantize none`` keeps float weights), unless
    `checkpoint_default` is False (a variant chosen only by name).
    `reads_weights_in_file`: the source recipe reads each weight a loader left in the file
    (:class:`llmcore.stored.FileWeight`) itself, one layer at a time (:func:`llmcore.stored.floats`,
    :func:`~llmcore.stored.rescale`, calibration through
    :func:`~llmcore.stored.read_while_running`); an export with it asks the loader to leave
    float weights there too, so that the model is never held whole in fp32.
    `parity_reference(converted)`: for a pt2e recipe whose backend computes the quantized
    graph differently from the graph's own eager semantics (XNNPACK quantizes dynamic
    activations per token where the graph says per tensor), the eager module that computes
    what the backend computes, for the parity check. It may rewrite ``converted`` in place
    (the program has been captured from it by then).
    """

    kind: ClassVar[str] = "quantizer recipe"
    description: str
    backends: tuple[str, ...] = ()
    pt2e_quantizer: Optional[Callable[[dict], Any]] = None
    after_convert: Optional[Callable[[Any], None]] = None
    source_quantize: Optional[Callable[[Any, dict], Any]] = None
    options: Mapping[str, tuple[type, Any, str]] = field(default_factory=dict)
    for_quantized_checkpoints: bool = False
    checkpoint_default: bool = True
    parity_reference: Optional[Callable[[Any], Any]] = None
    calibrated: bool = False
    reads_weights_in_file: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.pt2e_quantizer is None) == (self.source_quantize is None):
            raise ValueError(
                f"quantizer recipe {self.name!r}: set exactly one of pt2e_quantizer "
                "and source_quantize"
            )


# --------------------------------------------------------------------------------------
# Partitioners
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EdgeSettings:
    """The parts of ExecuTorch's `EdgeCompileConfig` a backend cares about.

    With several backends the pipeline merges them: IR validity is checked only when
    every backend allows it, and dim-order ops are skipped when any backend asks.
    """

    check_ir_validity: bool = True
    skip_dim_order: bool = False


@dataclass(frozen=True)
class Backend(Record):
    """A backend the pipeline can lower to.

    `partitioners(options)` returns the ExecuTorch partitioner objects for this backend
    (usually one). `runtime_id` is the backend id the runtime registers
    (e.g. the string a delegate carries), used to tell whether a `.pte` can run here.
    """

    kind: ClassVar[str] = "backend"
    description: str
    partitioners: Callable[[dict], list]
    edge: EdgeSettings = EdgeSettings()
    runtime_id: str = ""
    runs_on: str = ""
    """Where programs for this backend execute, in words (for error messages)."""
    options: Mapping[str, tuple[type, Any, str]] = field(default_factory=dict)
    while_lowering: Callable[[dict], AbstractContextManager] | None = None
    """A context manager entered (with the backend's options) around lowering: for a
    backend that replaces parts of its library with drop-ins giving the same program
    faster. Heavy imports belong inside it."""
    upstream_patches: Optional[Callable[[], Sequence[Any]]] = None
    """Returns the :class:`llmcore.upstream.Patch` records that ``while_lowering`` applies
    (registered with :func:`llmcore.upstream.register`). An export that selects the backend
    checks each one that is switched on against the installed releases when it plans, before
    it loads a model; keep the module it imports light (a :class:`Lazy` to it)."""
    default_order: Optional[int] = None
    """Where this backend stands in the list an export gets without ``--plugins`` when it has a
    checkpoint or a recipe (a program for this CPU): installed backends with a number, lowest
    first; None keeps it out of that list. llmcore-kernels' ``kernels`` is 10 and
    llmcore-xnnpack's ``xnnpack`` 20: the layer kernels first, XNNPACK for what they leave."""
    recipe_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Recipe name -> option defaults this backend asks for when it is selected and the user
    set none of them (``{"8da8w": {"outlier_split": False}}``: integers its operators run).
    The first selected backend that asks decides; the export says so."""
    takes_modules: Optional[Callable[[Any, dict], "ModulesTaken"]] = None
    """For a backend whose operators the program calls by name (custom operators run by a
    :class:`RuntimeLibrary`) rather than a delegate: ``takes_modules(module, options)``
    swaps the parts of the eager, quantized module it runs for modules that call its
    operators, and returns :class:`ModulesTaken`. Called after quantization and before
    ``torch.export``, in the order of ``--plugins``, so that what it leaves goes to the
    backends after it, as a partitioner leaves nodes to the next one."""


@dataclass(frozen=True)
class ModulesTaken:
    """What a backend's ``takes_modules`` did to a module: what it now runs and, by name,
    what it left to the backends after it and why (for the export's summary and report)."""

    taken: tuple[str, ...]
    """The submodules it swapped (``layers.0``, ``output``), in the module's order."""
    left: tuple[str, ...] = ()
    """``"name: reason"`` for each part it could not take."""
    note: str = ""
    """One line for the summary when it took nothing as a whole (``no int4 or int8 linears``)."""


# --------------------------------------------------------------------------------------
# Post-passes
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PostPass(Record):
    """A graph pass applied to the edge program before `to_executorch`.

    `create()` returns an ExecuTorch/torch.fx pass instance. The pass runs when one of
    `backends` is selected (empty means always), in ascending `order`.

    `rewrites` names the operators the pass rewrites (``"aten::mm"``, as an operator's
    ``name()`` gives them); when given, the pass is skipped on a program whose graph calls
    none of them outside its delegates. Running a pass re-traces the whole program, and a
    pass with nothing to rewrite gives back the same program.
    """

    kind: ClassVar[str] = "post-pass"
    description: str
    create: Callable[[], Any]
    backends: tuple[str, ...] = ()
    order: int = 100
    rewrites: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------
# Runtime libraries
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeLibrary(Record):
    """A library of custom operator kernels that programs using its ops need at run time.

    A source transform that puts one of `ops` into a model makes every program exported
    from it need this library, in the exporting process (for export and the parity
    check) and in every process that runs the program. llmcore finds the libraries a
    program needs from the operators it calls, names them in the program
    (the `get_runtime_libraries` constant method) and in the export report, and loads
    them before it runs a program (`llmcore run`, `profile`, `eval`; see
    :func:`llmcore.runtime.libraries.load_program_libraries`).

    `name` is also the library's file name for native runners: `llmcore_runner` looks
    for `lib<name>.so` next to itself and in `LLMCORE_RUNTIME_LIBRARIES`.
    """

    kind: ClassVar[str] = "runtime library"
    description: str
    ops: tuple[str, ...]
    """Runtime operator names this library registers, `namespace::op.overload`
    (`"llmcore::rms_norm.out"`): what ExecuTorch's registry and a program's operator
    table call them."""
    python_module: Optional[str] = None
    """A module whose import registers the ops with both PyTorch (for export) and the
    ExecuTorch runtime of this process. It raises `LlmcoreError` when it cannot (the
    native library is not built, say)."""
    shared_library: Optional[Callable[[], Path]] = None
    """Returns the path of the runtime-only native library (ExecuTorch kernels, no
    PyTorch): what a runner without Python loads. Raises `LlmcoreError` when it is not
    built."""
    module_library: Optional[Callable[[], Path]] = None
    """Returns the path of the native library that importing `python_module` loads (the ops'
    PyTorch and ExecuTorch kernels in one), where running a program needs nothing else of
    that import: a process that has not imported the module loads this in its place
    (`Program.load`, `inspect`), since the import can cost seconds (ExecuTorch's LLM custom
    ops import its compiler). It is loaded with `torch.ops.load_library`, as the module
    does, so that importing the module later (an export in the same process) finds it
    loaded and registers nothing twice. Raises `LlmcoreError` when it is not there."""
    declared: bool = True
    """Whether a program that calls its ops names it in `get_runtime_libraries`, for native
    runners to find `lib<name>.so`. False for ExecuTorch's own kernel libraries (its LLM
    custom ops and quantized kernels), which every llmcore runtime has: `llmcore_runner`
    links them, and in Python they load like any other runtime library."""
    specialized: bool = False
    """Whether its kernels are faster variants of ops another library provides (ExecuTorch's
    own), registered under ExecuTorch kernel keys (the dtype and dim order of each tensor
    argument) instead of as the ops' fallback kernels. The runtime picks a kernel whose key
    matches a call's tensors over the fallback, and the two registrations coexist in one
    process whichever loads first (the same name registered twice as fallback aborts it).
    No program needs such a library: export does not name it, and running a program that
    calls its ops loads it, when its native library is built, besides the libraries that
    provide them (:func:`llmcore.runtime.libraries.load_specialized_kernels`)."""
    prepare: Optional[Callable[[tuple[str, ...]], None]] = None
    """Called before each program runs in Python (``Program.load``), with the backend ids of
    its delegates (empty when it has none), whether or not the program needs this library:
    for a setting of the library's that depends on the program. llmcore-kernels runs its
    kernels on threads of their own in a program with no delegate, and on ExecuTorch's pool
    beside delegates (``runtime/kernels/kernel_threads.h``); ``llmcore_runner`` makes
    the same choice."""
    preload: bool = False
    """Whether it is loaded, with its symbols global, before a process imports ExecuTorch's
    runtime bindings (:func:`llmcore.runtime.libraries.load_preloaded_libraries`). Such a library
    registers no ops: it changes what ExecuTorch's own libraries do by defining functions
    they call, which the dynamic linker binds to the first definition it finds when they
    load. In a process that imported the bindings before, it is not loaded."""


# --------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command(Record):
    """A subcommand of the ``llmcore`` command line: ``llmcore NAME ...``.

    ``add_arguments(parser)`` adds the command's arguments to its ``argparse`` subparser (and
    may set the parser's ``description`` and ``epilog``); ``run(args)`` runs it with the parsed
    ``argparse.Namespace`` and returns the exit status. Both are called only for the command
    the user names (``add_arguments`` for every command when the parser is built: keep its
    imports light). An :class:`~llmcore.errors.LlmcoreError` it raises is printed as one
    line, as for llmcore's own commands.

    ``needs`` lists the modules the command imports that a plain install may lack, and
    ``extra`` the optional-dependency group of the plugin's distribution that brings them:
    when one is missing, ``llmcore NAME`` fails in one line naming the extra
    (``pip install 'llmcore[serve]'``) before ``run`` is called.

    ``runs_program``: the command runs the ``.pte`` given as its ``pte`` argument in this
    process. It gets ``--threads`` and ``--mmap`` (the size of the ExecuTorch runtime's
    thread pool, and how the program's file is read), and PyTorch's own ops on its main
    thread keep to one thread, off the cores of the runtime's workers. ``eager``: it also
    runs eager PyTorch on its main thread (export's calibration, eval's reference model),
    which then uses every core. Whatever the command, the runtime's workers start no OpenMP
    teams of their own: ``llmcore`` sets that up before torch is imported.
    """

    kind: ClassVar[str] = "command"
    help: str
    add_arguments: Callable[[Any], None]
    run: Callable[[Any], int]
    extra: Optional[str] = None
    needs: tuple[str, ...] = ()
    runs_program: bool = False
    eager: bool = False
