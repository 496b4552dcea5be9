"""ExecuTorch's MPS partitioner, restricted to nodes whose shapes are static.

The MPS delegate builds an ``MPSGraph`` with fixed tensor shapes: a node with a symbolic
size (``sym_size``, a tensor of ``T`` tokens) fails its serialiser (``'SymInt' object
has no attribute 'dtype'``) or would bake in the example's length. llmcore always
exports with a dynamic sequence length; the ``mps-static-length`` transform makes
everything after the input padding static, and this partitioner hands MPS only those
static nodes (the padding and the selection of the last real position stay on the CPU).

ExecuTorch's MPS modules configure the *root* logger when imported
(``logging.basicConfig`` at INFO, one at DEBUG), which would flood the terminal; they
are imported through :func:`quiet_import`, which puts the root logger back.
"""

from __future__ import annotations

import logging
import warnings


def quiet_import():
    """Import ExecuTorch's MPS partitioner and preprocessor; undo their logging setup and
    keep their deprecation warnings (MPS is deprecated in favour of Core ML) quiet."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            from executorch.backends.apple.mps import mps_preprocess  # noqa: F401
            from executorch.backends.apple.mps.operators import op_quant_dequant  # noqa: F401
            from executorch.backends.apple.mps.partition import mps_partitioner
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
    return mps_partitioner


def _symbolic(value) -> bool:
    import torch

    if isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(d, torch.SymInt) for d in value.shape)
    if isinstance(value, (list, tuple)):
        return any(_symbolic(v) for v in value)
    return False


def is_static(node) -> bool:
    """A call whose output and inputs all have concrete shapes (no symbolic sizes)."""
    import torch

    if _symbolic(node.meta.get("val")):
        return False
    args = list(node.args) + list(node.kwargs.values())
    flat = []
    while args:
        a = args.pop()
        if isinstance(a, (list, tuple)):
            args.extend(a)
        else:
            flat.append(a)
    return not any(isinstance(a, torch.fx.Node) and _symbolic(a.meta.get("val")) for a in flat)


def make_partitioner(fp16: bool):
    mps = quiet_import()
    from executorch.exir.backend.backend_details import CompileSpec
    from executorch.exir.backend.canonical_partitioners.pattern_op_partitioner import (
        generate_partitions_from_list_of_nodes,
    )
    from torch.fx.passes.operator_support import OperatorSupportBase

    class _StaticOnly(OperatorSupportBase):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def is_node_supported(self, submodules, node) -> bool:
            return is_static(node) and self.inner.is_node_supported(submodules, node)

    class StaticMPSPartitioner(mps.MPSPartitioner):
        """MPS partitioner that takes only statically shaped nodes."""

        def generate_partitions(self, edge_program):
            support = mps.MPSOperatorSupport(edge_program, self.delegation_spec.compile_specs)
            self.supported_ops = _StaticOnly(support)
            return generate_partitions_from_list_of_nodes(edge_program.graph_module, op_support=self.supported_ops)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return StaticMPSPartitioner([CompileSpec("use_fp16", bytes([bool(fp16)]))])
