"""Retracing a lowered program without running its delegates' graphs again.

After lowering, every ExecuTorch pass that re-traces the program (the post-passes, and
``to_executorch``'s spec propagation, quant fusion, dim-order and memory-planning passes)
meets each ``executorch_call_delegate`` node and must say what it returns. ExecuTorch's
fake-tensor rule for that node rebuilds the delegate's original program as a module
(``ExportedProgram.module()``: unlift, code generation) and runs all of its operators on
fake tensors, once per delegate per pass: a large share of an export (docs/performance.md,
"Measurements behind the code"), for outputs whose shapes the program already records.

:func:`recorded_outputs` answers from that record instead (installed while retracing by
the ``recorded_delegate_outputs`` patch of :mod:`llmcore.upstream`): each output of the
delegate's program has a traced value whose sizes are integers or symbols of the
program's own inputs (``s0``: the sequence length). Binding those symbols to the sizes
of the call's actual arguments gives the outputs' sizes in the caller's symbols; they are
made as new contiguous fake tensors of the recorded dtypes, which is what running the
graph gives for the contiguous outputs a delegate returns. Anything else (an output size
that is an expression, a non-contiguous or non-tensor output, arguments that do not
match the record, outputs other than user outputs) takes ExecuTorch's own rule, so this is
a shortcut that never changes a program: ``plugins/xnnpack/tests/test_lowering.py`` checks
that the export writes the same bytes with and without it.
"""

from __future__ import annotations

from typing import Any

import torch


class _Unrecorded(Exception):
    """The record does not answer for this call; use ExecuTorch's own rule."""


def _bind(recorded: torch.Tensor, actual: Any, bindings: dict) -> None:
    if not isinstance(actual, torch.Tensor) or actual.dtype != recorded.dtype or actual.dim() != recorded.dim():
        raise _Unrecorded("argument differs from the record")
    for want, got in zip(recorded.shape, actual.shape):
        if isinstance(want, int):
            if not isinstance(got, int) or got != want:
                raise _Unrecorded("a static size differs")
            continue
        expr = want.node.expr
        if not expr.is_Symbol:
            raise _Unrecorded(f"input size {expr} is an expression")
        if expr in bindings and _key(bindings[expr]) != _key(got):
            raise _Unrecorded(f"{expr} is bound to two sizes")
        bindings[expr] = got


def _key(size: Any) -> Any:
    """A size as something comparable without guarding: an int, or a symbolic expression."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _size(dim: Any, bindings: dict) -> Any:
    if isinstance(dim, int):
        return dim
    expr = dim.node.expr
    if expr not in bindings:
        raise _Unrecorded(f"output size {expr} is an expression, not an input's size")
    return bindings[expr]


def recorded_outputs(lowered_module, args: tuple) -> Any:
    """The delegate's outputs as fake tensors, from its program's record (see the module
    docstring); raises :class:`_Unrecorded` when the record does not answer."""
    from torch.export.graph_signature import InputKind, OutputKind

    program = lowered_module.original_module
    signature = program.graph_signature
    if any(spec.kind != OutputKind.USER_OUTPUT for spec in signature.output_specs):
        raise _Unrecorded("the delegate writes buffers")
    user_inputs = [spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT]
    flat_args = [a for a in torch.utils._pytree.tree_leaves(args)]
    if len(flat_args) != len(user_inputs):
        raise _Unrecorded("argument count differs from the record")
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    bindings: dict = {}
    for name, actual in zip(user_inputs, flat_args):
        recorded = placeholders[name].meta.get("val")
        if not isinstance(recorded, torch.Tensor):
            raise _Unrecorded("an input has no traced tensor")
        _bind(recorded, actual, bindings)
    outputs = []
    for node in program.graph.output_node().args[0]:
        recorded = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(recorded, torch.Tensor) or not recorded.is_contiguous():
            raise _Unrecorded("an output is not a contiguous tensor")
        outputs.append(torch.empty([_size(d, bindings) for d in recorded.shape], dtype=recorded.dtype))
    return torch.utils._pytree.tree_unflatten(outputs, program.call_spec.out_spec)
