"""ATen to edge dialect (``to_edge``'s conversion) with its operator-local passes fused.

ExecuTorch's ``_generate_edge_program`` runs about a dozen passes in a row. Seven of them
rewrite one operator at a time (``ExportPass.call_operator``: a transpose made a permute,
scalars made tensors, an ATen operator made its edge twin ...), and each does it in a whole
retrace of the program with fake tensors, a cost paid in full even on the two decoder blocks
that :mod:`llmcore.pipeline.repeated` converts (docs/performance.md, "Measurements behind
the code").

Passes that only rewrite operators one by one compose: a class deriving from all of them,
in their order, sends each operator through the first pass's ``call_operator``, whose
``super().call_operator`` is the next pass's, and so on to ``ExportPass``'s, which emits
it. Each pass sees exactly the operators the pass before it emitted, as it would have
seen them in its own retrace, and the run of passes costs one retrace. Only passes listed in
:data:`OPERATOR_LOCAL_PASSES` (read for this: they keep no state across operators and
override nothing else of substance) are fused, and only runs of them that are adjacent
in ExecuTorch's own order; the others run as ExecuTorch runs them.

This mirrors ``_generate_edge_program`` step for step: it is the ``fused_edge_passes``
patch of :mod:`llmcore.upstream`, whose record holds the digest of the source it mirrors
(an ExecuTorch whose function differs fails loudly; switched off, ExecuTorch's own runs).
``plugins/xnnpack/tests/test_lowering.py`` compares the programs written through here with
ExecuTorch's whole-graph lowering, byte for byte.
"""

from __future__ import annotations

from llmcore import upstream

# ExecuTorch's passes that override only ``call_operator`` (and ``__init__`` without
# arguments), or, for ScalarToTensorPass, also ``call`` only to report whether it changed
# anything, by class name.
OPERATOR_LOCAL_PASSES = frozenset(
    {
        "NormalizeTransposePass",
        "ReplaceBrokenOpsWithFunctionalOpsPass",
        "ScalarToTensorPass",
        "SymToTensorPass",
        "RemoveMixedTypeOperators",
        "OpReplacePass",
        "MemoryFormatOpsPass",
    }
)

def fused(passes: list) -> list:
    """``passes`` with each run of two or more adjacent operator-local passes (see the
    module docstring) replaced by one pass that applies them in the same order."""
    from executorch.exir.pass_base import ExportPass

    out: list = []
    run: list = []

    def flush() -> None:
        if len(run) >= 2:
            classes = tuple(type(p) for p in run)
            combined = type("+".join(c.__name__ for c in classes), classes, {})
            out.append(combined())
        else:
            out.extend(run)
        run.clear()

    for p in passes:
        instance = getattr(p, "__wrapped__", p)  # ExportedProgramPassManager wraps each pass
        cls = type(instance)
        if isinstance(instance, ExportPass) and cls.__name__ in OPERATOR_LOCAL_PASSES and ExportPass in cls.__bases__:
            run.append(instance)
        else:
            flush()
            out.append(p)
    flush()
    return out


def generate_edge_program(config, program, core_aten_ops_exception_list=None, preserve_ops=None):
    """``executorch.exir.program._program._generate_edge_program`` with the same arguments,
    its operator-local passes fused."""
    from executorch.exir.program import _program as exir

    if not upstream.active("fused_edge_passes"):
        return exir._generate_edge_program(config, program, core_aten_ops_exception_list, preserve_ops)

    # the steps of ExecuTorch's _generate_edge_program, in its order
    program = exir.remove_unused_parameters_pass(program)
    pre_op_replace_passes, post_op_replace_passes = exir._get_aten_to_edge_passes(config)
    passes = [exir.RemoveNonCoreAtenOpGraphAssertsPass(), exir.ReplaceViewOpsWithViewCopyOpsPass()]
    passes.extend(pre_op_replace_passes)
    passes.append(exir.OpReplacePass())
    if not config._skip_dim_order:
        passes.append(exir.MemoryFormatOpsPass())
    passes = fused(passes)

    gm = program.graph_module
    for p in passes:
        result = p(gm)
        assert result is not None
        gm = result.graph_module

    edge_program = exir.ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=exir._get_updated_graph_signature(program.graph_signature, gm),
        state_dict=program.state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=[
            exir.EXIREdgeDialectVerifier(
                edge_compile_config=config,
                class_only=True,
                core_aten_ops_exception_list=core_aten_ops_exception_list,
                preserve_ops=preserve_ops,
            )
        ],
    )
    edge_program = exir.lift_constant_tensor_pass(edge_program)
    edge_program = exir.convert_constant_dim_order_pass.convert_constant_dim_order_pass(edge_program)
    return exir._transform(edge_program, *post_op_replace_passes)
