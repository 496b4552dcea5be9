"""Every change llmcore makes to ExecuTorch's and torch's internals, in one place.

The export is faster and leaner than ExecuTorch's own flow because, while it lowers and
emits, llmcore swaps a few private functions and classes of ExecuTorch and torch for ones
that give the same answers with less work, or takes a shorter path that a private function
of theirs would otherwise take. Each such change is a :class:`Patch` record in
:data:`PATCHES`: its name, what it swaps (``replaces``), the upstream code whose behaviour
it reproduces or assumes (``relies_on``, each with the digest of the source it was written
against), the releases it was written for (``requires``), why it exists, and how to apply
it. The records of the core are at the end of this file; a plugin declares its own through
:func:`register` (XNNPACK's are in ``plugins/xnnpack/llmcore_xnnpack/lowering.py``), so
``upstream.PATCHES`` lists every patch of the plugins in use.

What is kept here and what is not: the code that writes into ExecuTorch or torch (each
swap and its undoing) is here, next to its record, so that an upgrade reads one file. The
algorithms a swap installs are ordinary llmcore code where the stage that uses them lives
(:class:`llmcore.pipeline.lower.LeanDependencyViewer`, :func:`llmcore.pipeline.lower.legalize_order`,
:func:`llmcore.pipeline.delegates.recorded_outputs`, ...): they touch nothing upstream, and
their tests are those modules' tests.

Applying a patch (:func:`applied`, or :func:`active` for a shortcut that is a code path
rather than a swap) first checks it:

- **The switch.** ``LLMCORE_UPSTREAM_PATCHES_OFF=all`` turns every patch off,
  ``LLMCORE_UPSTREAM_PATCHES_OFF=legalize_in_place,remembered_passes`` those named: the
  export then runs ExecuTorch's and torch's own code there, and writes the same bytes
  (the tests that compare the two use this switch).
- **The range.** A patch is applied only on the releases it was written for; on any
  other, applying it raises one :class:`UpstreamPatchError` line naming the patch, its
  range, the installed version and what to do. It never goes silently unapplied: a
  shortcut that quietly stops applying is an export that quietly gets slower, and one that
  applies to code it was not written for may write a different program.
- **The code it relies on.** Within the range, each ``relies_on`` function or class
  must still exist with the source whose digest the record holds (one digest per source
  seen in the range): a patch release that rewrote it fails the same way, naming it.

On an ExecuTorch or torch upgrade, ``tests/test_upstream.py`` (and each plugin's test of
its own patches) fails naming every patch whose range or digests no longer hold. For each:
read what it replaces and relies on in the new release; if the patch still gives the same
program (the byte-for-byte tests in ``plugins/xnnpack/tests/test_lowering.py`` compare the
export with every patch on and every patch off), widen ``requires`` and add the new digests
(:func:`digest` gives them); if not, fix it, or drop it: switching it off is what the
unpatched export runs.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Mapping, Optional

from llmcore.errors import LlmcoreError
from llmcore.records import Record

log = logging.getLogger(__name__)

SWITCH = "LLMCORE_UPSTREAM_PATCHES_OFF"
"""Environment variable: ``all``, or the names of the patches to turn off, comma-separated."""


class UpstreamPatchError(LlmcoreError):
    """A patch was asked to apply to an ExecuTorch or torch it was not written for."""


@dataclass(frozen=True)
class Patch(Record):
    """One change to ExecuTorch's or torch's internals.

    Targets are written ``"package.module:attribute"``, or ``"package.module:Class.method"``.
    """

    replaces: tuple[str, ...]
    """The upstream attributes set to llmcore's while the patch is applied (empty for a
    shortcut that takes its own code path instead of swapping one)."""
    relies_on: Mapping[str, tuple[str, ...]]
    """Upstream functions and classes the patch reproduces or assumes, each with the
    :func:`digest` of every source of it the patch was checked against."""
    requires: tuple[str, ...]
    """The releases it was written for, as requirements: ``"executorch>=1.4.1,<1.6"``."""
    why: str
    """What it saves, and why the result is the same."""
    apply: Optional[Callable[[], ContextManager]] = None
    """Makes the change for the length of a ``with`` block; None for a code path that asks
    :func:`active` instead."""
    module: str = __name__
    """Where the record and its code are (a plugin's module for a plugin's patch)."""

    kind = "upstream patch"


PATCHES: dict[str, Patch] = {}
"""Every registered patch by name: the core's, and those of the plugins imported so far."""


def register(patch: Patch) -> Patch:
    """Add ``patch`` to :data:`PATCHES` (a plugin calls this when its module is imported).
    Registering the same record again does nothing; another record of the same name is an
    error that names both modules."""
    known = PATCHES.get(patch.name)
    if known is not None and known != patch:
        raise LlmcoreError(
            f"upstream patch {patch.name!r} is declared twice: in {known.module} and in {patch.module}.",
            stage="plugins",
            fix="rename one of them.",
        )
    PATCHES[patch.name] = patch
    return patch


# ---- checking a patch -------------------------------------------------------------------


def switched_off() -> frozenset[str]:
    """The names in :data:`SWITCH` (``"all"`` among them turns every patch off)."""
    return frozenset(n.strip() for n in os.environ.get(SWITCH, "").split(",") if n.strip())


def is_switched_off(name: str) -> bool:
    off = switched_off()
    return "all" in off or name in off


_warned: set[str] = set()


def warn_unknown_switch_names() -> None:
    """Warn once about each name in :data:`SWITCH` that no registered patch has (called
    when lowering has registered the patches of the backends in use)."""
    unknown = sorted(switched_off() - set(PATCHES) - {"all"} - _warned)
    if unknown:
        _warned.update(unknown)
        log.warning("%s names %s, which no upstream patch in use has; the patches: all, %s",
                    SWITCH, ", ".join(map(repr, unknown)), ", ".join(sorted(PATCHES)))


@functools.lru_cache(maxsize=None)
def installed_version(package: str) -> Optional[str]:
    """The installed version of a distribution, or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def resolve(target: str) -> Any:
    """The object a ``"module:attr.attr"`` target names (raises when it does not exist)."""
    module, _, path = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = vars(obj)[part] if isinstance(obj, type) else getattr(obj, part)
    return obj


@functools.lru_cache(maxsize=None)
def _module_source(module: str) -> tuple[list[str], ast.Module]:
    source = inspect.getsource(importlib.import_module(module))
    return source.splitlines(keepends=True), ast.parse(source)


@functools.lru_cache(maxsize=None)
def digest(target: str) -> str:
    """The first 16 hex digits of the sha256 of the source of the function or class a
    ``"module:name"`` target names, decorators included, as ``relies_on`` records it.

    Read from the module's file, not from the live object: while a patch is applied, the
    module holds llmcore's replacement. Raises LookupError when the module does not define it."""
    module, _, path = target.partition(":")
    lines, node = _module_source(module)
    for part in path.split("."):
        node = next((n for n in getattr(node, "body", ()) if isinstance(n, _DEFINITIONS) and n.name == part), None)
        if node is None:
            raise LookupError(f"{module} defines no {path}")
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return hashlib.sha256("".join(lines[start - 1:node.end_lineno]).encode()).hexdigest()[:16]


def _out_of_range(requirement: str) -> Optional[str]:
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    version = installed_version(req.name)
    if version is None:
        return f"{req.name} is not installed"
    if not req.specifier.contains(version, prereleases=True):
        return f"{req.name} {version} is installed"
    return None


def problems(patch: Patch) -> list[str]:
    """Why ``patch`` cannot apply to what is installed, one sentence each (empty when it can)."""
    found = _out_of_ranges(patch)
    if found:
        return found  # its targets may be anything on another release
    for target in patch.replaces:
        try:
            resolve(target)
        except (ImportError, AttributeError, KeyError):
            found.append(f"it replaces {target}, which the installed release does not have")
    for target, digests in patch.relies_on.items():
        try:
            got = digest(target)
        except (ImportError, LookupError, OSError):
            found.append(f"it relies on {target}, which the installed release does not have")
            continue
        if got not in digests:
            found.append(f"it relies on {target}, whose source (digest {got}) is not one it was written "
                         f"against ({', '.join(digests)})")
    return found


def _out_of_ranges(patch: Patch) -> list[str]:
    found = []
    for requirement in patch.requires:
        why = _out_of_range(requirement)
        if why:
            found.append(f"it was written for {requirement}, and {why}")
    return found


def _refused(patch: Patch, found: list[str], stage: Optional[str] = None) -> UpstreamPatchError:
    where = patch.module.replace(".", "/") + ".py"
    return UpstreamPatchError(
        f"upstream patch {patch.name!r} ({', '.join(patch.requires)}) cannot apply: {'; '.join(found)}.",
        stage=stage,
        fix=f"check that it still gives the same program and update its record in {where} "
            f"(range, digests), or turn it off with {SWITCH}={patch.name}.",
    )


def check(name: str) -> Patch:
    """The patch named ``name``, or an :class:`UpstreamPatchError` when it cannot apply."""
    patch = PATCHES[name]
    found = problems(patch)
    if found:
        raise _refused(patch, found)
    return patch


def check_ranges(names) -> None:
    """Each named patch that is switched on was written for the installed releases, or an
    :class:`UpstreamPatchError` (stage ``plan``) for the first that was not: the export
    plan's check (:func:`llmcore.pipeline.plan.plan_export`), before a model is loaded. Reads
    installed versions only, no upstream module; the code each patch relies on is checked
    when it applies (:func:`check`)."""
    for name in names:
        if is_switched_off(name):
            continue
        found = _out_of_ranges(PATCHES[name])
        if found:
            raise _refused(PATCHES[name], found, stage="plan")


def active(name: str) -> bool:
    """Whether the patch ``name`` applies: False when the switch turns it off, True when it
    can apply, an :class:`UpstreamPatchError` otherwise."""
    if is_switched_off(name):
        log.debug("upstream patch %r is off (%s)", name, SWITCH)
        return False
    check(name)
    return True


@contextmanager
def applied(name: str) -> Iterator[Any]:
    """The patch ``name`` applied for the length of the block (yields what its ``apply``
    yields), or nothing changed when the switch turns it off."""
    if not active(name):
        yield None
        return
    with PATCHES[name].apply() as value:
        yield value


@contextmanager
def replaced(*swaps: tuple[str, Any]) -> Iterator[None]:
    """Set each ``(target, new)`` for the length of the block; the originals are put back
    in reverse order."""
    saved = []
    try:
        for target, new in swaps:
            module, _, path = target.partition(":")
            *outer, attr = path.split(".")
            owner = resolve(f"{module}:{'.'.join(outer)}") if outer else importlib.import_module(module)
            saved.append((owner, attr, vars(owner)[attr]))
            setattr(owner, attr, new)
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


# ---- the core's patches ---------------------------------------------------------------------

EXECUTORCH = "executorch>=1.4.1,<1.6"
EXECUTORCH_1_5 = "executorch>=1.5,<1.6"
TORCH = "torch>=2.13,<2.14"

_TORCH_VIEWER = "torch.fx.passes.infra.partitioner:_DependencyViewer"
_GROUP_PARTITIONER = "executorch.exir.backend.canonical_partitioners.group_partitioner"
_CONFIG_PARTITIONER = "executorch.exir.backend.canonical_partitioners.config_partitioner"
_MATCHED_NODES = f"{_CONFIG_PARTITIONER}:ConfigerationBasedPartitioner.get_matched_nodes_from_configs"
_TYPE_HINTS = "executorch.exir._serialize._dataclass:get_type_hints"
_LEGALIZE = "executorch.exir.lowered_backend_module:legalize_graph"
_QUANT_FUSION = "executorch.exir.program._program:quant_fusion_and_const_prop_pass"
_HOP_FAKE_FNS = "torch._higher_order_ops.utils:registered_hop_fake_fns"
_EMIT_CONSTANT = "executorch.exir.emit._emitter:_Emitter._tensor_spec_to_evalue"


def _lean_dependency_viewers() -> ContextManager:
    from llmcore.pipeline.lower import LeanDependencyViewer, _can_merge_partitions

    return replaced(
        (_TORCH_VIEWER, LeanDependencyViewer),
        (f"{_GROUP_PARTITIONER}:_DependencyViewer", LeanDependencyViewer),
        (f"{_GROUP_PARTITIONER}:GroupBasedPartitioner._can_merge_partitions", _can_merge_partitions),
    )


def _type_hints_read_once() -> ContextManager:
    return replaced((_TYPE_HINTS, functools.lru_cache(maxsize=None)(resolve(_TYPE_HINTS))))


def _constant_inputs_listed_once() -> ContextManager:
    """While a config-based partitioner matches one program's nodes, ``is_constant_data``
    reads a set of that program's constant inputs; any other program gets ExecuTorch's answer."""
    from llmcore.pipeline.lower import constant_input_names

    module = importlib.import_module(_CONFIG_PARTITIONER)
    original = resolve(_MATCHED_NODES)
    is_constant_data = module.is_constant_data

    def get_matched_nodes_from_configs(self, ep):
        names = constant_input_names(ep)
        module.is_constant_data = lambda program, node: (
            node.name in names if program is ep else is_constant_data(program, node))
        try:
            return original(self, ep)
        finally:
            module.is_constant_data = is_constant_data

    return replaced((_MATCHED_NODES, get_matched_nodes_from_configs))


@contextmanager
def _legalize_in_place() -> Iterator[None]:
    """``create_submodule_from_nodes`` sorts the graph in place (:func:`legalize_order`),
    and each module sorted so is recompiled once, when the block ends."""
    from llmcore.pipeline.lower import legalize_order

    pending: dict = {}  # id -> module whose code is out of date

    def legalize(gm):
        root = gm.graph._root
        order = legalize_order(gm.graph)
        position = {node: i for i, node in enumerate(order)}
        for node in order:
            root.prepend(node)  # to the end: the nodes end up in that order
            # torch.fx copies the nodes into a new graph in that order, so each node's users
            # come to be listed in it too; the next sort reads them in that order
            users = sorted(node.users, key=position.__getitem__)
            node.users.clear()
            node.users.update(dict.fromkeys(users))
        pending[id(gm)] = gm
        return gm

    try:
        with replaced((_LEGALIZE, legalize)):
            yield
    finally:
        for gm in pending.values():
            gm.recompile()


def forget_lowered_nodes() -> int:
    """Drop the references to graph nodes that ExecuTorch's lowering keeps in module-level
    state once it is done (the ``WhyNoPartition`` loggers of its partitioner configs, each
    holding the last node it turned down, and the unbounded cache of
    ``executorch.exir.backend.utils.is_same_node``); returns how many it dropped."""
    import sys

    from executorch.exir.backend import utils

    dropped = utils.is_same_node.cache_info().currsize
    utils.is_same_node.cache_clear()
    for name, module in list(sys.modules.items()):
        if not name.startswith("executorch.") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, utils.WhyNoPartition) and value.node is not None:
                value.node = None
                dropped += 1
    return dropped


@contextmanager
def _forgetting_lowered_nodes() -> Iterator[None]:
    try:
        yield
    finally:
        forget_lowered_nodes()


def _quant_fusion_only_where_quantized() -> ContextManager:
    """``to_executorch``'s quant fusion runs where the graph outside the delegates calls a
    quantize or dequantize operator, reads a dtype through ``getattr`` or has a node without
    a traced value; elsewhere only its dead-code removal and constant propagation run."""
    from executorch.exir.passes.constant_prop_pass import constant_prop_pass

    from llmcore.pipeline.emit import is_quantize_operator

    original = resolve(_QUANT_FUSION)

    def fusion_where_quantized(program):
        nodes = [n for n in program.graph_module.graph.nodes if n.op == "call_function"]
        if any(is_quantize_operator(n) or n.target is getattr or "val" not in n.meta for n in nodes):
            return original(program)
        program.graph_module.graph.eliminate_dead_code()
        program.graph_module.recompile()
        return constant_prop_pass(program)

    return replaced((_QUANT_FUSION, fusion_where_quantized))


# Constants smaller than this are copied into the program's buffers as upstream copies them:
# the large ones (weights) are what emitting in place is for.
IN_PLACE_CONSTANT_BYTES = 1 << 16


def _constants_emitted_in_place() -> ContextManager:
    """Each large constant goes into the program's buffers as its own memory, not a copy of
    it: the writer reads the bytes from the tensor when it writes the file. Upstream copies
    each constant into a ``bytes`` object while the graph still holds it, so an export held
    its weights twice through emission (an 8B model's 4.7 GB program, 9.4 GB); releasing each
    weight once copied still held the largest twice, and a tied table is the first and largest
    (Llama-3.2-1B: 250 MiB over the export's peak). A program buffer may be ``bytes`` or a
    ``Cord`` (ExecuTorch's bytes in parts, which is how the writer joins them), so the view
    is a Cord whose one part is the storage's memory; nothing copies it (``deepcopy`` gives
    it back, as it does ``bytes``). The edge program's weights must not change until the
    program is written: llmcore writes it at once and drops both."""
    import ctypes
    import hashlib

    from executorch.exir._serialize import _cord
    from executorch.exir.schema import EValue

    original = resolve(_EMIT_CONSTANT)
    make_tensor_value = resolve("executorch.exir.emit._emitter:make_tensor_value")
    # ExecuTorch 1.5's Cord asks a part that is not bytes to write itself (as its file-backed
    # data does); 1.4's writes each part with outfile.write, which takes a memoryview as it is
    parts_write_themselves = hasattr(_cord, "FileBackedData")

    class MemoryPart:
        """A storage's bytes as ExecuTorch 1.5's Cord reads a part that is not ``bytes``."""

        def __init__(self, view: memoryview) -> None:
            self.view = view

        def __len__(self) -> int:
            return len(self.view)

        def to_bytes(self) -> bytes:
            return bytes(self.view)

        def write_to_file(self, outfile) -> None:
            outfile.write(self.view)

    class StorageBytes(_cord.Cord):
        """A torch storage's bytes, where they are, as one part of a Cord; holds the storage."""

        def __init__(self, storage) -> None:
            super().__init__()
            view = memoryview((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())).cast("B")
            self.storage, self.digest = storage, hashlib.sha256(view).hexdigest()
            self._buffers = [MemoryPart(view) if parts_write_themselves else view]
            self._byte_size = len(view)

        def __deepcopy__(self, memo) -> "StorageBytes":
            return self

    emitted: dict[int, int] = {}  # the storage's StorageImpl -> the program buffer it went to

    def emitted_in_place(self, spec, constant_tag=None):
        storage = spec.storage if spec.const else None
        planned = spec.mem_id is not None and spec.mem_offset is not None  # a mutable buffer's initial state
        if (storage is None or planned or spec.extra_tensor_info is not None
                or storage.nbytes() < IN_PLACE_CONSTANT_BYTES or spec.nbytes() != storage.nbytes()):
            return original(self, spec, constant_tag)  # (a view of part of a storage: upstream's error)
        key = storage._cdata
        if key not in emitted:
            data = StorageBytes(storage)
            hashed = data.digest
            found = self.program_state.cached_spec_hash_values.get(hashed, -1)
            emitted[key] = found if found != -1 else self._save_new_const_tensor(spec, data, hashed, None, constant_tag)
        return EValue(make_tensor_value(emitted[key], None, spec))

    return replaced((_EMIT_CONSTANT, emitted_in_place))


@contextmanager
def _recorded_delegate_outputs() -> Iterator[dict]:
    """Fake-tensor tracing of ``executorch_call_delegate`` answers from the delegate's
    recorded outputs when it can (:func:`llmcore.pipeline.delegates.recorded_outputs`), by
    ExecuTorch's rule otherwise. Yields the counts of calls answered so (``recorded``) and
    traced (``traced``)."""
    from torch._higher_order_ops.executorch_call_delegate import executorch_call_delegate

    from llmcore.pipeline import delegates

    fake_fns = resolve(_HOP_FAKE_FNS)
    original = fake_fns[executorch_call_delegate]
    counts = {"recorded": 0, "traced": 0}

    def fake(lowered_module, *args):
        try:
            out = delegates.recorded_outputs(lowered_module, args)
        except delegates._Unrecorded as why:
            counts["traced"] += 1
            log.debug("delegate traced: %s", why)
            return original(lowered_module, *args)
        counts["recorded"] += 1
        return out

    fake_fns[executorch_call_delegate] = fake
    try:
        yield counts
    finally:
        fake_fns[executorch_call_delegate] = original
        if counts["recorded"] or counts["traced"]:
            log.info("delegate calls answered from their records: %d, traced: %d", counts["recorded"], counts["traced"])


for _patch in (
    Patch(
        name="lean_dependency_viewers",
        replaces=(
            _TORCH_VIEWER,
            f"{_GROUP_PARTITIONER}:_DependencyViewer",
            f"{_GROUP_PARTITIONER}:GroupBasedPartitioner._can_merge_partitions",
        ),
        relies_on={
            _TORCH_VIEWER: ("47bacdf03efdce20",),
            f"{_GROUP_PARTITIONER}:_DependencyViewer": ("a6d3ee37edb6ec3a",),
            f"{_GROUP_PARTITIONER}:GroupBasedPartitioner._can_merge_partitions": ("08428a6ba5abd129",),
        },
        requires=(TORCH, EXECUTORCH),
        why="The partitioners' dependency viewers hold every node's transitive users as Python "
            "sets, quadratic in the graph (they were the export's peak memory); the lean viewer "
            "keeps them as bitmasks and answers the same, and the group partitioner's merge check, "
            "which asked it twice per pair (a large share of lowering), asks once, on cached masks.",
        apply=_lean_dependency_viewers,
    ),
    Patch(
        name="legalize_in_place",
        replaces=(_LEGALIZE,),
        relies_on={
            "torch.fx.passes.tools_common:legalize_graph": ("6dc8094b32ebd463",),
            "executorch.exir.lowered_backend_module:create_submodule_from_nodes": (
                "039c4842e05e15a2",  # 1.4.1
                "3279f5ec23b0b723",  # 1.5.1: the outputs' metadata copied differently
            ),
        },
        requires=(TORCH, EXECUTORCH),
        why="After cutting out each delegate, ExecuTorch re-sorts the whole graph with torch.fx's "
            "legalize_graph, which copies every node and regenerates the module's code, once per "
            "delegate (a noticeable share of lowering); the same order is computed and the nodes "
            "moved into it in place, their users listed in it as the copy lists them, with the code "
            "generated once when lowering ends.",
        apply=_legalize_in_place,
    ),
    Patch(
        name="constant_inputs_listed_once",
        replaces=(_MATCHED_NODES,),
        relies_on={
            _MATCHED_NODES: ("0a4b7b5eef4b1a06",),
            f"{_CONFIG_PARTITIONER}:is_constant_data": ("87f02620097396a2",),
        },
        requires=(EXECUTORCH,),
        why="ExecuTorch's is_constant_data asks the graph signature, which rebuilds its parameter, "
            "buffer and constant mappings on every call, for every node of every candidate "
            "partition (a noticeable share of lowering); the program does not change while "
            "nodes are matched, so one set per program gives the same answers.",
        apply=_constant_inputs_listed_once,
    ),
    Patch(
        name="type_hints_read_once",
        replaces=(_TYPE_HINTS,),
        relies_on={"executorch.exir._serialize._dataclass:_DataclassEncoder": ("83458adfaf5e5bf7",)},
        requires=(EXECUTORCH,),
        why="The dataclass-to-JSON encoder that XNNPACK, Vulkan and QNN serialize their delegates "
            "with re-evaluates a class's annotations for every field of every object (a noticeable "
            "share of serializing a model's delegates); a class's hints do not change, so reading them "
            "once gives the same JSON.",
        apply=_type_hints_read_once,
    ),
    Patch(
        name="forget_lowered_nodes",
        replaces=(),
        relies_on={
            "executorch.exir.backend.utils:is_same_node": ("4dfa4eb003545769",),
            "executorch.exir.backend.utils:WhyNoPartition": ("dc9f0fa647a2f7fc",),
        },
        requires=(EXECUTORCH,),
        why="When lowering ends, the nodes ExecuTorch keeps in module-level state (the last node "
            "each partitioner config turned down, read only by a debug message, and is_same_node's "
            "unbounded cache) are dropped: they kept the whole lowered program, its constants "
            "included, alive to the end of the process, walked by every later garbage collection.",
        apply=_forgetting_lowered_nodes,
    ),
    Patch(
        name="quant_fusion_only_where_quantized",
        replaces=(_QUANT_FUSION,),
        relies_on={"executorch.exir.passes.quant_fusion_pass:quant_fusion_and_const_prop_pass": ("beb8839b5b53783d",)},
        requires=(EXECUTORCH,),
        why="to_executorch's QuantFusionPass matches 23 patterns, each starting from a quantize or "
            "dequantize operator, over the graph outside the delegates (a noticeable share of emit "
            "where the delegates hold all of them); where the graph calls none, the pass only drops "
            "dead code, so that and the constant propagation run instead.",
        apply=_quant_fusion_only_where_quantized,
    ),
    Patch(
        name="constants_emitted_in_place",
        replaces=(_EMIT_CONSTANT,),
        relies_on={
            _EMIT_CONSTANT: ("f3b5b9a22e5e8125",),
            "executorch.exir.emit._emitter:_Emitter._save_new_const_tensor": ("6b9ac7c29901c3a9",),
            "executorch.exir._serialize._cord:Cord": ("cb4a84f49dcec087", "ee7d59a588d87f0b"),
        },
        requires=(EXECUTORCH,),
        why="to_executorch copies every constant into a bytes object while the graph still holds "
            "it, so an export held its weights twice (an 8B model's 4.7 GB program, 9.4 GB); each "
            "large constant goes into the program's buffers as its own memory instead, which the "
            "writer reads when it writes the file: the same bytes, never held twice.",
        apply=_constants_emitted_in_place,
    ),
    Patch(
        name="recorded_delegate_outputs",
        replaces=(_HOP_FAKE_FNS,),
        relies_on={
            "torch._higher_order_ops.executorch_call_delegate:call_delegate_fake_tensor_mode": ("d692c8ae03197911",),
        },
        requires=(TORCH, EXECUTORCH),
        why="Every pass that retraces the lowered program runs each delegate's whole original "
            "program on fake tensors to learn what it returns (a large share of an export); "
            "the outputs' sizes and dtypes are recorded in that program, and are read from there "
            "instead where the record answers.",
        apply=_recorded_delegate_outputs,
    ),
    Patch(
        name="decomposed_in_one_retrace",
        replaces=(),
        relies_on={"executorch.exir.program._program:_gen_edge_manager_for_partitioners": ("14a2b38bd338a215",)},
        requires=(EXECUTORCH_1_5,),
        why="For a single partitioner that keeps its operators without a filter, the repeated-block "
            "lowering functionalizes and decomposes the kept blocks in one retrace where ExecuTorch "
            "makes two: the partitioner names the same operators before functionalization, which "
            "rewrites only mutations (llmcore.pipeline.repeated.edge_template).",
    ),
    Patch(
        name="fused_edge_passes",
        replaces=(),
        relies_on={"executorch.exir.program._program:_generate_edge_program": ("231b0ef63ff582cb",)},
        requires=(EXECUTORCH,),
        why="The conversion to the edge dialect runs seven passes that each rewrite one operator at "
            "a time in a retrace of their own; adjacent ones run as one pass, in the same order, in "
            "one retrace (llmcore.pipeline.edge, which repeats _generate_edge_program's steps).",
    ),
):
    register(_patch)
del _patch
