"""Lowering a model of N repeated blocks by converting the first few.

An LLM's graph is N copies of one decoder layer, or of a short cycle of layer kinds (Gemma
2's sliding and global layers take turns; Gemma 3 has five sliding layers per global one).
``to_edge`` (decompositions, then eight or so edge passes, each a whole-graph fake-tensor
retrace) costs the same for every copy, and on a 30-layer model it was most of the lowering
(docs/performance.md, "Measurements behind the code"). Its rewrites are local to the nodes
they touch, so layer k comes out of it as an earlier layer of its kind does, with layer k's
weights.

So :func:`lower_repeated` does this:

1. finds the repeated blocks in the ATen program (``nn_module_stack`` paths ``<list>.<i>``,
   e.g. ``layers.7``) and the shortest period p with which blocks 1..N-1 repeat: block i is
   the same graph as block i - p (the same operators, shapes and wiring, each reading its
   own weights and the block before it) (:func:`find_blocks`); the first block reads the
   prelude instead, which is why block 0 is not a template;
2. cuts the program down to its prelude, blocks 0 to :attr:`Blocks.kept` (one full period
   after block 0, ending on the kind of the last block) and its postlude
   (:func:`first_blocks`), and runs ExecuTorch's ``to_edge`` on that: blocks 0 and 1 when
   every block is the same;
3. copies each later block from the kept block of its kind, each copy reading its own
   weights and the copy before it (:func:`expand`), which gives the edge program of the
   whole model;
4. lets the partitioners lower that program as ``to_edge_transform_and_lower`` would.

When a program does not have that shape (no repeated blocks, blocks that differ, weights
that ``to_edge`` rewrote), :class:`NotRepeated` says why, before any long work, and
lowering takes the whole-graph path: this is a shortcut, never a different program.
``plugins/xnnpack/tests/test_lowering.py`` checks that both paths write the same ``.pte``,
byte for byte; ``--whole-graph-lowering`` takes the whole-graph path on request.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import Node

log = logging.getLogger(__name__)

_INDEXED = re.compile(r"^(?P<list>.+)\.(?P<i>\d+)$")
# ``u12``: an unbacked symbol (each ``.item()`` in a block makes its own); shapes compare
# with these numbered per block.
_UNBACKED = re.compile(r"\bu\d+\b")
_QUOTED_NAME = re.compile(r"'[A-Za-z_]\w*'")
# a tensor of an indexed module (``layers.7.wq.weight``): a block's own, by name, not local
_INDEXED_FQN = re.compile(r"(^|\.)\d+\.")


class NotRepeated(Exception):
    """The program is not N identical blocks; the message says what differs."""


@dataclass
class Blocks:
    """The repeated blocks of an ATen program: ``prefix`` (``layers``) and, for each block,
    its call_function nodes in graph order and its local tensors: the targets of the
    parameters, buffers and constants that only it reads and whose names do not say whose
    they are (pt2e's ``_scale_12``, ``_zero_point_12``), in the order the block first reads
    them. Block ``k``'s ``j``-th local tensor is its template's ``j``-th (:meth:`template_of`),
    with block ``k``'s values."""

    prefix: str
    nodes: list[list[Node]]
    local: list[list[str]] = dataclasses.field(default_factory=list)
    period: int = 1
    """Blocks ``i`` and ``i + period`` are the same graph (from block 1 on): 1 when every
    block is, 2 for Gemma 2's sliding and global layers taking turns, 6 for Gemma 3's."""

    def fqn_prefix(self, i: int) -> str:
        return f"{self.prefix}.{i}."

    @property
    def kept(self) -> int:
        """The last block the cut-down program keeps: at least one full period after block
        0, and the same graph as the last block, which the postlude reads."""
        last = len(self.nodes) - 1
        return self.period + (last - self.period) % self.period

    def template_of(self, k: int) -> int:
        """The kept block that block ``k`` (> :attr:`kept`) is a copy of."""
        return k - self.period * -(-(k - self.kept) // self.period)

    def local_of(self, target: str) -> Optional[tuple[int, int]]:
        """``(block, position)`` of a local tensor, or None."""
        for i, targets in enumerate(self.local):
            if target in targets:
                return i, targets.index(target)
        return None


def _claimed(node: Node) -> bool:
    """Whether a submodule (not just the exported root) claims ``node``."""
    return any(path for path, _type in (node.meta.get("nn_module_stack") or {}).values())


def gather_block_nodes(ep) -> int:
    """Give the nodes that no module claims and that compute inside one block (pt2e's
    quantize, dequantize and choose-qparams nodes) that block, and move each to just before
    its first user, so that each block is one contiguous run of nodes. A node is given block
    ``b`` when all its users are in ``b`` and each of its inputs is a placeholder (a weight, a
    scale), a node of ``b`` or of the block before it; what reads the prelude stays in the
    prelude. Returns how many nodes were given a block.

    Only nodes are moved, to later places that still precede every user, and only metadata
    naming the module is added: the program computes the same. :func:`lower` runs this on
    every program, on both lowering paths, so that the two stay comparable byte for byte.
    """
    nodes = list(ep.graph.nodes)
    # users first: the block each unclaimed node's users are all in
    wanted: dict[Node, tuple] = {}
    for node in reversed(nodes):
        if node.op != "call_function" or not node.users or _claimed(node):
            continue
        paths = {wanted.get(u) or (_block_path(u) if u.op == "call_function" else None) for u in node.users}
        if len(paths) == 1 and None not in paths:
            wanted[node] = paths.pop()
    # then inputs: a node joins only if everything it reads is a placeholder, in its block
    # or in the block before it (the block's input, as a layer reads the layer before); and
    # its users must still be in its block once the others are decided: until nothing changes
    given: dict[Node, tuple] = dict(wanted)

    def block_of(n: Node):
        if n in given:
            return given[n]
        return _block_path(n) if n.op == "call_function" and _claimed(n) else None

    def fits(node: Node, block: tuple) -> bool:
        readable = {block, (block[0], block[1] - 1)} if block[1] > 0 else {block}
        return all(a.op == "placeholder" or block_of(a) in readable for a in node.all_input_nodes) and all(
            block_of(u) == block for u in node.users
        )

    changed = True
    while changed:
        changed = False
        for node in [n for n in nodes if n in given]:
            if not fits(node, given[node]):
                del given[node]
                changed = True
    for node in reversed(nodes):
        if node not in given:
            continue
        first = node.next
        while first not in node.users:
            first = first.next
        stack = next(u for u in node.users if u in given or _claimed(u)).meta["nn_module_stack"]
        node.meta["nn_module_stack"] = dict(stack)
        if first is not node.next:
            first.prepend(node)
    if given:
        ep.graph_module.recompile()
    return len(given)


def _block_path(node: Node) -> Optional[tuple[str, int]]:
    for path, _type in (node.meta.get("nn_module_stack") or {}).values():
        m = _INDEXED.match(path)
        if m:
            return m["list"], int(m["i"])
    return None


def _owners(ep) -> dict[str, str]:
    """placeholder name -> the FQN of the parameter, buffer or constant it reads."""
    sig = ep.graph_signature
    return {
        **sig.inputs_to_parameters,
        **sig.inputs_to_buffers,
        **sig.inputs_to_lifted_tensor_constants,
    }


def find_blocks(ep, min_blocks: int = 3) -> Blocks:
    """The repeated blocks of ``ep``, checked to be copies of each other, or of the block
    one period before (see the module docstring); raises :class:`NotRepeated` otherwise."""
    groups: dict[tuple[str, int], list[Node]] = {}
    order: list[tuple[str, int]] = []
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        key = _block_path(node)
        if key is None:
            continue
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(node)
    prefixes = {p for p, _ in order}
    if not prefixes:
        raise NotRepeated("no node belongs to an indexed module list")
    prefix = max(prefixes, key=lambda p: sum(1 for q, _ in order if q == p))
    keys = [k for k in order if k[0] == prefix]
    if [i for _, i in keys] != list(range(len(keys))) or len(keys) < min_blocks:
        raise NotRepeated(f"{prefix}: {len(keys)} blocks, not {min_blocks} or more in order")
    blocks = Blocks(prefix, [groups[k] for k in keys])

    # Contiguous: nothing outside a block runs between its first and last node.
    position = {node: i for i, node in enumerate(ep.graph.nodes)}
    for i, nodes in enumerate(blocks.nodes):
        if position[nodes[-1]] - position[nodes[0]] + 1 != len(nodes):
            raise NotRepeated(f"{prefix}.{i} is interleaved with other nodes")
    owners = _owners(ep)
    blocks.local = [_local_tensors(ep, blocks, owners, i) for i in range(len(blocks.nodes))]
    structures = [None] + [_structure(blocks, owners, i) for i in range(1, len(blocks.nodes))]
    n = len(blocks.nodes)
    for period in range(1, n):
        # worth it only if the cut-down program (blocks 0..kept) leaves some to copy
        if period + (n - 1 - period) % period >= n - 1:
            differs = next(i for i in range(2, n) if structures[i] != structures[1])
            raise NotRepeated(f"{prefix}.{differs} is not the same graph as {prefix}.1 "
                              f"({_first_difference(structures[1], structures[differs])}), and the blocks do not "
                              "repeat with a longer period either")
        if all(structures[i] == structures[i - period] for i in range(period + 1, n)):
            blocks.period = period
            break
    _check_outside_uses(ep, blocks)
    return blocks


def _local_tensors(ep, blocks: Blocks, owners: dict[str, str], i: int) -> list[str]:
    """Block ``i``'s local tensors (:class:`Blocks`), in the order it first reads them."""
    own = set(blocks.nodes[i])
    prefix = blocks.fqn_prefix(i)
    local: list[str] = []
    for node in blocks.nodes[i]:
        for a in node.all_input_nodes:
            fqn = owners.get(a.name) if a.op == "placeholder" else None
            if fqn is None or fqn.startswith(prefix) or fqn in local:
                continue
            if all(u in own for u in a.users) and _INDEXED_FQN.match(fqn) is None:
                local.append(fqn)
    return local


def _structure(blocks: Blocks, owners: dict[str, str], i: int) -> tuple:
    """Block ``i`` as a comparable value: operators, arguments (own nodes by position, the
    block before it by position, its own weights by relative FQN with their shapes and
    types, anything else by name) and value shapes (unbacked symbols renumbered)."""
    own = {node: j for j, node in enumerate(blocks.nodes[i])}
    before = {node: j for j, node in enumerate(blocks.nodes[i - 1])}
    mine, theirs = blocks.fqn_prefix(i), blocks.fqn_prefix(i - 1)
    local = blocks.local[i]
    symbols: dict[str, str] = {}

    def renumbered(text: str) -> str:
        return _UNBACKED.sub(lambda m: symbols.setdefault(m[0], f"u#{len(symbols)}"), text)

    def shape(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            text = f"{tuple(value.shape)}:{value.dtype}"
        elif isinstance(value, (list, tuple)):
            return tuple(shape(v) for v in value)
        else:
            text = type(value).__name__ if value is not None else "None"
            if isinstance(value, torch.SymInt):
                text = str(value)
        return renumbered(text)

    def arg(a: Any) -> Any:
        if isinstance(a, Node):
            if a in own:
                return ("own", own[a])
            if a in before:
                return ("before", before[a])
            fqn = owners.get(a.name)
            if fqn is not None and not all(u in own for u in a.users):
                return ("shared", a.name)  # one tensor for many blocks (export lifts it once)
            # A block's own tensors by their place and by their shape and type: a copy takes
            # its template's tensor specs, so two blocks whose weights are held in different
            # forms (a GGUF's Q4_K_S mixes Q4_K and Q5_0 layers: nibbles and int8 rows, the
            # operators' outputs the same) are not copies of each other.
            if fqn is not None and fqn.startswith(mine):
                return ("weight", fqn[len(mine):], shape(a.meta.get("val")))
            if fqn is not None and fqn in local:
                return ("local", local.index(fqn), shape(a.meta.get("val")))
            if fqn is not None and fqn.startswith(theirs):
                return ("weight of the block before", fqn)
            return ("outside", a.name)
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, arg(v)) for k, v in a.items())
        if isinstance(a, str):  # a runtime assertion's message names its symbols and nodes
            return _QUOTED_NAME.sub("'#'", renumbered(a))
        return repr(a)

    return tuple(
        (str(node.target), arg(node.args), arg(node.kwargs), shape(node.meta.get("val")))
        for node in blocks.nodes[i]
    )


def _first_difference(one: tuple, other: tuple) -> str:
    """Where block ``other`` first differs from block ``one`` (two :func:`_structure`
    values), in a few words: the log line that says why lowering takes the whole graph names
    the operator and the argument (a GGUF's layers holding a weight in other forms, a layer of
    another kind)."""
    for j, ((op_a, args_a, kwargs_a, value_a), (op_b, args_b, kwargs_b, value_b)) in enumerate(zip(one, other)):
        if op_a != op_b:
            return f"its node {j} is {op_b}, not {op_a}"
        if args_a != args_b:
            i = next((i for i, (a, b) in enumerate(zip(args_a, args_b)) if a != b), min(len(args_a), len(args_b)))
            if i < min(len(args_a), len(args_b)):
                return f"{op_b}'s argument {i}: {args_b[i]}, not {args_a[i]}"
            return f"{op_b} takes {len(args_b)} arguments, not {len(args_a)}"
        if kwargs_a != kwargs_b:
            return f"{op_b}'s keyword arguments: {kwargs_b}, not {kwargs_a}"
        if value_a != value_b:
            return f"{op_b} gives {value_b}, not {value_a}"
    return f"{len(other)} nodes, not {len(one)}"


def _check_outside_uses(ep, blocks: Blocks) -> None:
    """Only the next block reads a block, and only the postlude reads the last one."""
    member = {node: i for i, nodes in enumerate(blocks.nodes) for node in nodes}
    last = len(blocks.nodes) - 1
    for node, i in member.items():
        for user in node.users:
            j = member.get(user)
            if j == i or (j == i + 1) or (j is None and i == last and user.op != "output"):
                continue
            where = "the output" if user.op == "output" else (f"block {j}" if j is not None else user.name)
            raise NotRepeated(f"{blocks.prefix}.{i} is read by {where}")


# ---- step 2: the program cut down to two blocks ------------------------------------------


def first_blocks(ep, blocks: Blocks):
    """``ep`` with the blocks after :attr:`Blocks.kept` removed and the postlude reading
    that block instead of the last (blocks 0 and 1 when every block is the same)."""
    from torch.export import ExportedProgram
    from torch.export.graph_signature import ExportGraphSignature

    kept = blocks.kept
    gm = copy.deepcopy(ep.graph_module)
    old_nodes = list(ep.graph.nodes)
    new_of = dict(zip(old_nodes, gm.graph.nodes))
    last = blocks.nodes[-1]
    reroute = {new_of[a]: new_of[b] for a, b in zip(last, blocks.nodes[kept])}
    dropped = {new_of[n] for nodes in blocks.nodes[kept + 1:] for n in nodes}
    for node in gm.graph.nodes:
        if node not in dropped and node not in reroute:
            node.args = torch.fx.map_arg(node.args, lambda a: reroute.get(a, a))
            node.kwargs = torch.fx.map_arg(node.kwargs, lambda a: reroute.get(a, a))
    for node in reversed(list(gm.graph.nodes)):
        if node in dropped:
            gm.graph.erase_node(node)

    later = tuple(blocks.fqn_prefix(i) for i in range(kept + 1, len(blocks.nodes)))
    later_local = {fqn for targets in blocks.local[kept + 1:] for fqn in targets}
    owners = _owners(ep)
    # Their weights and local tensors go too; a tensor they share with the kept blocks stays.
    gone = set()
    for node in list(gm.graph.nodes):
        fqn = owners.get(node.name, "")
        if node.op == "placeholder" and (fqn.startswith(later) or fqn in later_local) and not node.users:
            gone.add(node.name)
            gm.graph.erase_node(node)
    input_specs = [s for s in ep.graph_signature.input_specs if s.arg.name not in gone]
    gm.recompile()
    dropped_targets = {owners[name] for name in gone}
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=ExportGraphSignature(
            input_specs=input_specs, output_specs=list(ep.graph_signature.output_specs)
        ),
        state_dict={k: v for k, v in ep.state_dict.items() if k not in dropped_targets},
        range_constraints=ep.range_constraints,
        module_call_graph=copy.deepcopy(ep.module_call_graph),
        example_inputs=ep.example_inputs,
        constants={k: v for k, v in ep.constants.items() if k not in dropped_targets},
        verifiers=ep.verifiers,
    )


# ---- step 3: the edge program of the whole model, from the two-block one -----------------


def _edge_region(ep, prefix: str, i: int) -> list[Node]:
    """Block ``i``'s nodes in an edge program: from its first to its last node with the
    block's module path; nodes between them may have no path (e.g. a tuple's getitem)."""
    nodes = [n for n in ep.graph.nodes if n.op != "placeholder"]
    tagged = [j for j, n in enumerate(nodes) if n.op == "call_function" and _block_path(n) == (prefix, i)]
    if not tagged:
        raise NotRepeated(f"to_edge left no node of {prefix}.{i}")
    region = nodes[tagged[0]:tagged[-1] + 1]
    for n in region:
        path = _block_path(n) if n.op == "call_function" else None
        if n.op != "call_function" or (path is not None and path != (prefix, i)):
            raise NotRepeated(f"{n.name} ({path}) lies inside {prefix}.{i} after to_edge")
    return region


def _renamed_stack(meta: dict, old: str, new: str) -> dict:
    pattern = re.compile(rf"(?<![\w.]){re.escape(old)}(?=\.|$)")
    stack = meta.get("nn_module_stack")
    if not stack:
        return meta
    meta = dict(meta)
    meta["nn_module_stack"] = {
        key.replace(old, new): (pattern.sub(new, path), kind) for key, (path, kind) in stack.items()
    }
    return meta


def _tensor(ep, fqn: str):
    if fqn in ep.state_dict:
        return ep.state_dict[fqn]
    return ep.constants.get(fqn)


def expand(edge_ep, aten_ep, blocks: Blocks):
    """The edge program of all N blocks, from ``edge_ep`` (the cut-down program after
    ``to_edge``: blocks 0 to :attr:`Blocks.kept`), with each copy's weights taken from
    ``aten_ep`` (the whole program). Block k > kept is a copy of block
    :meth:`Blocks.template_of` (k), reading the copy before it where its template reads the
    block before that."""
    from torch.export import ExportedProgram
    from torch.export.graph_signature import (
        ExportGraphSignature,
        InputKind,
        InputSpec,
        OutputKind,
        OutputSpec,
        TensorArgument,
    )

    prefix, n_blocks, kept, period = blocks.prefix, len(blocks.nodes), blocks.kept, blocks.period
    gm = edge_ep.graph_module
    graph = gm.graph
    regions = [_edge_region(edge_ep, prefix, i) for i in range(kept + 1)]
    for i in range(period, kept + 1):
        if [str(n.target) for n in regions[i]] != [str(n.target) for n in regions[i - period]]:
            raise NotRepeated(f"to_edge made {prefix}.{i - period} and {prefix}.{i} different graphs")
    positions = [{n: j for j, n in enumerate(region)} for region in regions]
    templates = range(kept - period + 1, kept + 1)  # the blocks that later ones copy

    specs = list(edge_ep.graph_signature.input_specs)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    aten_names = {s.target: s.arg.name for s in aten_ep.graph_signature.input_specs if s.target}
    outputs = list(graph.output_node().args[0])
    own_specs: dict[int, list] = {}  # template block -> its weights', buffers' and lifted constants' specs
    local_constants: set[str] = set()
    mutations: dict[int, list] = {}  # template block -> (output index, spec) of its buffer writes
    for t in templates:
        mine, pos = blocks.fqn_prefix(t), positions[t]
        local_t = set(blocks.local[t]) if blocks.local else set()
        own = [
            s for s in specs
            if ((s.target or "").startswith(mine) or s.target in local_t)
            and all(u in pos for u in placeholders[s.arg.name].users)
        ]
        for spec in own:
            template, whole = _tensor(edge_ep, spec.target), _tensor(aten_ep, spec.target)
            if template is None or whole is None:
                raise NotRepeated(f"{spec.target} is not a tensor of both programs")
            if template is not whole and not (
                template.shape == whole.shape and template.dtype == whole.dtype and torch.equal(template, whole)
            ):
                raise NotRepeated(f"to_edge rewrote {spec.target}")
        # Constants that to_edge lifted out of the block (a norm's epsilon): each copy gets
        # its own, as each block of a whole program does.
        lifted = {
            s.arg.name for s in specs
            if s.kind in (InputKind.CONSTANT_TENSOR, InputKind.BUFFER) and _tensor(aten_ep, s.target) is None
            and _tensor(edge_ep, s.target) is not None
            and placeholders[s.arg.name].users and all(u in pos for u in placeholders[s.arg.name].users)
        }
        local_constants |= lifted
        own_specs[t] = [s for s in specs if s in own or s.arg.name in lifted]
        mutations[t] = [
            (j, s) for j, s in enumerate(edge_ep.graph_signature.output_specs)
            if s.kind == OutputKind.BUFFER_MUTATION and (s.target or "").startswith(mine)
        ]
        if any(outputs[j] not in pos for j, _ in mutations[t]):
            raise NotRepeated(f"a buffer of {prefix}.{t} is written outside the block")
    all_own = {s.arg.name for t in templates for s in own_specs[t]}

    copy_of: dict[Node, int] = {}  # node -> the block it copies (for debug handles)
    sanitized = prefix.replace(".", "_")
    state_dict, constants = dict(edge_ep.state_dict), dict(edge_ep.constants)
    added_specs: list[tuple[int, int, Any]] = []  # (block, index of its template's spec, the copy's spec)
    output_node = graph.output_node()
    added_outputs: list[tuple[Node, Any]] = []  # the copies' buffer mutations
    taken = set(placeholders)
    previous = regions[kept]
    postlude = regions[kept][-1].next  # every copy goes before it, in order
    for k in range(kept + 1, n_blocks):
        t = blocks.template_of(k)
        first, mine = blocks.fqn_prefix(t), blocks.fqn_prefix(k)
        own_pos, before_pos = positions[t], positions[t - 1]
        weights = {}
        for spec in own_specs[t]:
            old = placeholders[spec.arg.name]
            if spec.arg.name in local_constants:
                fqn = name = f"{spec.target}_{sanitized}_{k}"
                tensor = _tensor(edge_ep, spec.target)
                persistent = spec.target in edge_ep.state_dict
            elif blocks.local and spec.target in blocks.local[t]:  # block k's tensor in the same place
                fqn = blocks.local[k][blocks.local[t].index(spec.target)]
                tensor = _tensor(aten_ep, fqn)
                persistent = fqn in aten_ep.state_dict
                name = aten_names[fqn]
            else:
                fqn = mine + spec.target[len(first):]
                tensor = _tensor(aten_ep, fqn)
                persistent = fqn in aten_ep.state_dict
                name = old.name.replace(f"{sanitized}_{t}_", f"{sanitized}_{k}_", 1)
            if tensor is None:
                raise NotRepeated(f"{fqn} is missing from the program")
            while name in taken:  # a tensor that export lifted once for all blocks keeps its name
                name += "_"
            taken.add(name)
            with graph.inserting_before(old):
                new = graph.placeholder(name)
            new.meta = _renamed_stack(copy.copy(old.meta), f"{prefix}.{t}", f"{prefix}.{k}")
            weights[old] = new
            (state_dict if persistent else constants)[fqn] = tensor
            added_specs.append((k, specs.index(spec), InputSpec(
                kind=spec.kind, arg=TensorArgument(name=new.name), target=fqn, persistent=spec.persistent)))

        copies: dict[Node, Node] = {}

        def source(a, copies=copies, weights=weights, previous=previous, own_pos=own_pos, before_pos=before_pos):
            if a in own_pos:
                return copies[a]
            if a in before_pos:
                return previous[before_pos[a]]
            return weights.get(a, a)

        with graph.inserting_before(postlude):
            for node in regions[t]:
                new = graph.node_copy(node, source)
                new.meta = _renamed_stack(new.meta, f"{prefix}.{t}", f"{prefix}.{k}")
                copies[node] = new
                copy_of[new] = k
        for j, spec in mutations[t]:
            value = copies[outputs[j]]
            added_outputs.append((value, OutputSpec(
                kind=OutputKind.BUFFER_MUTATION, arg=TensorArgument(name=value.name),
                target=mine + spec.target[len(first):],
            )))
        previous = [copies[n] for n in regions[t]]

    # The postlude reads the last copy (a copy of the last kept block).
    last = {n: previous[j] for n, j in positions[kept].items()}
    mutation_values = {outputs[j] for t in templates for j, _ in mutations[t]}
    for node in regions[kept]:
        for user in list(node.users):
            if user not in positions[kept] and user not in copy_of and user.op != "output":
                user.replace_input_with(node, last[node])
    # Mutations come first in a program's outputs: the copies' follow the kept blocks'.
    values, output_specs = [], []
    after = max((j for t in templates for j, _ in mutations[t]), default=-1)
    for j, (value, spec) in enumerate(zip(outputs, edge_ep.graph_signature.output_specs)):
        if value not in mutation_values:
            value = last.get(value, value)
            spec = dataclasses.replace(spec, arg=TensorArgument(name=value.name)) if value.name != spec.arg.name else spec
        values.append(value)
        output_specs.append(spec)
        if j == after:
            values.extend(v for v, _ in added_outputs)
            output_specs.extend(s for _, s in added_outputs)
    output_node.args = (tuple(values),)

    # The copies' inputs follow the kept blocks' last input of their group (parameters,
    # buffers, lifted constants), in block order: where a whole export puts them.
    def group(spec) -> tuple:
        return spec.kind, spec.arg.name in local_constants

    ordered = []
    for j, spec in enumerate(specs):
        ordered.append(spec)
        if spec.arg.name in all_own and not any(
            group(s) == group(spec) and s.arg.name in all_own for s in specs[j + 1:]
        ):
            ordered.extend(new for _, _, new in sorted(
                (entry for entry in added_specs if group(specs[entry[1]]) == group(spec)),
                key=lambda entry: (entry[0], entry[1])))
    # The inputs the whole program has keep the order to_edge gives them in it (pt2e's
    # scales, zero points and frozen weights are numbered across blocks, each kind after the
    # other); the others (constants to_edge lifted) keep the places given above.
    whole_order = _edge_input_order(aten_ep)
    known = [j for j, spec in enumerate(ordered) if spec.target in whole_order]
    for j, spec in zip(known, sorted((ordered[j] for j in known), key=lambda s: whole_order[s.target])):
        ordered[j] = spec
    by_name = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    body = next(n for n in graph.nodes if n.op != "placeholder")
    for spec in ordered:
        body.prepend(by_name[spec.arg.name])
    _number_debug_handles(graph, copy_of)
    graph.lint()
    gm.recompile()
    return ExportedProgram(
        root=gm,
        graph=graph,
        graph_signature=ExportGraphSignature(input_specs=ordered, output_specs=output_specs),
        state_dict=state_dict,
        range_constraints=edge_ep.range_constraints,
        module_call_graph=edge_ep.module_call_graph,
        example_inputs=edge_ep.example_inputs,
        constants=constants,
        verifiers=edge_ep.verifiers,
    )


def _edge_input_order(aten_ep) -> dict[str, tuple]:
    """Where ``to_edge`` puts each parameter, buffer and constant of ``aten_ep``: a sort key.

    Its decompositions re-export the program from a module rebuilt from the signature
    (``ExportedProgram.module()``), whose tensors are attached in signature order,
    parameters first, each creating the submodules on its path as needed. The re-export
    lists parameters and buffers as ``named_parameters`` / ``named_buffers`` walk that
    module: a module's own tensors, then its children in the order they were created. So a
    submodule holding buffers only (an int8 embedding table's ``q`` and ``scales``) moves
    behind the submodules created with parameters; other inputs keep their order."""
    specs = [s for s in aten_ep.graph_signature.input_specs if s.target]
    kinds: dict = {}
    for s in specs:
        kinds.setdefault(s.kind, len(kinds))
    tree: dict = {}  # module path -> {child name: subtree}, children in creation order
    own: dict[tuple, list[str]] = {}  # module path -> its own tensors, in attachment order
    for s in specs:
        *path, _ = s.target.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        own.setdefault(tuple(path), []).append(s.target)
    walk: list[str] = []

    def visit(path: tuple, node: dict) -> None:
        walk.extend(own.get(path, ()))
        for name, child in node.items():
            visit(path + (name,), child)

    visit((), tree)
    rank = {target: i for i, target in enumerate(walk)}
    order = {}
    for j, s in enumerate(specs):
        by_module = s.kind.name in ("PARAMETER", "BUFFER")
        order[s.target] = (kinds[s.kind], rank[s.target] if by_module else j)
    return order


def _number_debug_handles(graph, copy_of: dict) -> None:
    """Debug handles as ExecuTorch's ``DebugHandleGeneratorPass`` numbers a whole graph:
    1, 2, ... in node order, one per source node, each copy's nodes their own sources."""
    numbers: dict = {}
    for node in graph.nodes:
        handle = node.meta.get("debug_handle")
        if isinstance(handle, int):
            node.meta["debug_handle"] = numbers.setdefault((copy_of.get(node, 0), handle), len(numbers) + 1)


# ---- step 4: lowering ----------------------------------------------------------------------


def lower_repeated(exported, partitioners: list, config, constant_methods):
    """What ``to_edge_transform_and_lower(exported, partitioners, ...)`` gives, with
    ``to_edge`` run on two blocks only; raises :class:`NotRepeated` (before any long work)
    when the program is not made of identical blocks."""
    blocks = find_blocks(exported)
    template = first_blocks(exported, blocks)
    return to_edge_transform_and_lower(exported, template, blocks, partitioners, config, constant_methods)


def to_edge_transform_and_lower(exported, template, blocks: Blocks, partitioners: list, config, constant_methods):
    """ExecuTorch's flow of the same name, on ``template`` then the expanded program.

    (The name matters: partitioners warn that the graph was decomposed the old way unless
    this function name is on the stack, and here it was decomposed the new way.)
    """
    from executorch.exir.program._program import EdgeProgramManager

    whole = expand(edge_template(template, partitioners, config), exported, blocks)
    log.info("to_edge ran on %d of %d %s blocks (period %d); the other %d are copies",
             blocks.kept + 1, len(blocks.nodes), blocks.prefix, blocks.period, len(blocks.nodes) - blocks.kept - 1)
    manager = EdgeProgramManager(
        {"forward": whole},
        constant_methods,
        config,
        core_aten_ops_exception_list=config._core_aten_ops_exception_list,
        preserve_ops=config.preserve_ops,
    )
    for partitioner in partitioners:
        manager = manager.to_backend({"forward": partitioner})
    return manager


def edge_template(template, partitioners: list, config):
    """``template`` in the edge dialect, as ExecuTorch's ``_gen_edge_manager_for_partitioners``
    gives it (and ``config`` as it leaves it), with one decomposition retrace where ExecuTorch
    makes two.

    ExecuTorch first functionalizes the program (``run_decompositions({})``, a whole
    retrace), asks the partitioner which operators to keep, then decomposes the rest (a
    second retrace). When a single partitioner keeps its operators without a filter (the
    path ExecuTorch takes for it without ``EDGE_DO_NOT_DECOMP``), the second retrace
    functionalizes as it decomposes, so the first is redundant: asked before it, the
    partitioner names the same operators, since functionalizing rewrites only mutations,
    which no partitioner keeps. Saves a whole retrace of the kept blocks; the programs
    are byte-identical (``plugins/xnnpack/tests/test_lowering.py`` compares this path with
    ExecuTorch's whole-graph lowering). The conversion to the edge dialect that follows runs
    its operator-local passes fused (:mod:`llmcore.pipeline.edge`). Any other case, or the
    ``decomposed_in_one_retrace`` patch of :mod:`llmcore.upstream` switched off, takes
    ExecuTorch's own function."""
    from executorch.exir.program import _program as exir

    from llmcore import upstream
    from llmcore.pipeline import edge

    if len(partitioners) == 1 and upstream.active("decomposed_in_one_retrace"):
        program = exir._apply_pre_decomposition_transforms(template, partitioners)
        kept, check = partitioners[0].ops_to_not_decompose(program)
        if check is None:
            table = exir._default_decomposition_table()
            preserved = [op for op in kept if table.pop(op, None) is not None]
            program = program.run_decompositions(table)
            log.info("to_edge functionalized and decomposed the kept blocks in one retrace")
            config._core_aten_ops_exception_list = list(set(config._core_aten_ops_exception_list) | set(preserved))
            return edge.generate_edge_program(config, program, preserve_ops=preserved)
    manager = exir._gen_edge_manager_for_partitioners({"forward": partitioners}, {"forward": template}, config, None)
    return manager.exported_program("forward")
