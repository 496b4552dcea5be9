"""XNNPACK partitioning that stores a tied embedding / output-layer matrix once.

Where the second copy comes from
--------------------------------
GPT-2 (and SmolLM, Llama 3.2 1B, ...) use one matrix ``W[V, C]`` for the token embedding
and the output layer. ``torch.export`` keeps it as one parameter, read by two nodes:
``embedding(W, tokens)`` and ``linear(h, W)``. XNNPACK takes the linear but has no
gather, so the embedding stays in the portable runtime, and the two runtimes read their
constants from different places:

* a delegate serialises its constants into the program's named data (keyed by a hash of
  the bytes) and packs them into its own layout when the method loads;
* a portable operator reads the program's constant buffer.

Neither can read the other's store: a portable tensor may point at named data only as an
"external" constant, which the runtime resolves from a separate ``.ptd`` file and never
from the ``.pte`` itself (``PteDataMap`` has no tensor layouts). So the default XNNPACK
partitioner writes ``W`` twice (the plugin's README has the sizes for GPT-2 124M).

What we do instead
------------------
With ``share_tied_weights`` (the default) the partitioner leaves such an fp32 output layer
to the runtime's own ``linear`` kernel, which reads ``W`` from the constant buffer where
the embedding reads it: one copy. The linear is kept whole (not decomposed into
``permute + mm``), otherwise the transpose would be folded into a second, transposed
constant. The output layer of these models runs on the last position only (a
matrix-vector product, memory bound), where that kernel is as fast as XNNPACK's. The
alternative, XNNPACK with the weight as a runtime input, also stores it once but repacks
the weight on every call, so it is not offered (plugins/xnnpack/README.md has the
figures).

Quantized output layers are not affected: their weight is a new (quantized) tensor, not
the embedding's parameter, and XNNPACK takes them as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
from executorch.backends.xnnpack.partition.config.gemm_configs import LinearConfig
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner


def _op(target: Any) -> str:
    """The operator's name without namespace or overload: ``linear`` for aten and edge ops."""
    name = getattr(target, "__name__", None) or str(target)
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else parts[0]


def _weight(node: torch.fx.Node):
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")


def _constant(ep, node: torch.fx.Node):
    """The parameter, buffer or lifted constant a placeholder stands for, or None."""
    from torch._export.utils import get_buffer, get_lifted_tensor_constant, get_param

    for get in (get_param, get_buffer, get_lifted_tensor_constant):
        tensor = get(ep, node)
        if tensor is not None:
            return tensor
    return None


def _same_table(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or type(a) is not type(b):
        return False
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() or torch.equal(a, b)
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses
        return False


def _reads_table(node: torch.fx.Node, excluding: torch.fx.Node) -> bool:
    return any(user is not excluding and "embedding" in _op(user.target) for user in node.users)


def is_tied_output_layer(node: torch.fx.Node, ep=None) -> bool:
    """A linear whose weight is a parameter that an embedding lookup reads too.

    torch.export gives a tied parameter one placeholder that both read (its second name
    stays unused). Two parameters over one storage become two placeholders: with ``ep``
    (whose constants must be real tensors, not fake ones), a table with the same contents
    counts too, as the program stores equal constants once anyway (the emitter dedups
    them by their bytes).
    """
    if node.op != "call_function" or _op(node.target) != "linear":
        return False
    weight = _weight(node)
    if not isinstance(weight, torch.fx.Node) or weight.op != "placeholder":
        return False  # quantized (a dequantize node) or computed: not the shared table
    if _reads_table(weight, excluding=node):
        return True
    value = _constant(ep, weight) if ep is not None else None
    if value is None:
        return False
    return any(
        other.op == "placeholder"
        and other is not weight
        and _reads_table(other, excluding=node)
        and (table := _constant(ep, other)) is not None
        and _same_table(value, table)
        for other in node.graph.nodes
    )


class SharedTableLinearConfig(LinearConfig):
    """XNNPACK's linear config, refusing output layers tied to an embedding."""

    # Names of weight placeholders found tied in the ATen graph, where the constants are
    # real; the partitioner fills it (placeholder names survive to_edge).
    tied_weights: "set[str] | frozenset[str]" = frozenset()

    def check_constraints(self, node: torch.fx.Node, ep) -> bool:
        # While partitioning, the program's constants are fake tensors: contents cannot be
        # compared, so a tie seen through the contents counts only by name.
        weight = _weight(node)
        if is_tied_output_layer(node) or (isinstance(weight, torch.fx.Node) and weight.name in self.tied_weights):
            return False
        return super().check_constraints(node, ep)


# Operators that only give a tensor another shape: a partition of nothing else computes
# nothing, yet costs a delegate call each forward (its inputs and outputs bound, its
# runtime entered; docs/performance.md, "Measurements behind the code"), where the
# runtime's own view is free.
_SHAPE_ONLY = frozenset({"view_copy", "squeeze_copy", "unsqueeze_copy"})


class FastDecompositionPartitioner(XnnpackPartitioner):
    """XNNPACK's partitioner, letting ExecuTorch take its one-retrace decomposition path
    whenever that keeps the same ops (see :func:`llmcore_xnnpack.lowering.ops_to_not_decompose`),
    and leaving out partitions that only reshape (what is left of a program whose layers and
    output layer run on other kernels, llmcore-kernels' ``-layers`` recipes)."""

    def generate_partitions(self, ep):
        return [p for p in super().generate_partitions(ep)
                if not all(_op(n.target) in _SHAPE_ONLY for n in p.nodes if n.op == "call_function")]

    def ops_to_not_decompose(self, ep):
        from llmcore_xnnpack.lowering import ops_to_not_decompose

        return ops_to_not_decompose(ep, *self._ops_and_filter(ep))

    def _ops_and_filter(self, ep):
        return super().ops_to_not_decompose(ep)


class SharedTablePartitioner(FastDecompositionPartitioner):
    """XNNPACK partitioner that leaves tied output layers, whole, to the portable runtime."""

    def __init__(self, **kwargs):
        configs = [SharedTableLinearConfig if c is LinearConfig else c for c in ALL_PARTITIONER_CONFIGS]
        super().__init__(configs=configs, **kwargs)
        self.tied_weights: set[str] = set()
        for config in self.target_partitioner_configs.values():
            if isinstance(config, SharedTableLinearConfig):
                config.tied_weights = self.tied_weights

    def _ops_and_filter(self, ep):
        ops, keep = super()._ops_and_filter(ep)

        def keep_or_tied(node: torch.fx.Node) -> bool:
            # A tied linear must stay `linear`: decomposed, its weight transpose would be
            # constant-folded into a second copy of the table. Only in the ATen graph that
            # to_edge decomposes: after lowering, ExecuTorch asks again, on the edge graph,
            # to check that every op kept for a partitioner was delegated, and the tied
            # linear, deliberately left out, must not count as one of those.
            if isinstance(node.target, torch._ops.OpOverload) and is_tied_output_layer(node, ep):
                self.tied_weights.add(_weight(node).name)
                return True
            return keep(node) if keep is not None else False

        if torch.ops.aten.linear.default not in ops:
            ops = [*ops, torch.ops.aten.linear.default]
        return ops, keep_or_tied


def partitioners(options: dict) -> list:
    from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType

    kwargs: dict[str, Any] = {"per_op_mode": options["per_op_mode"]}
    if options["fp32_only"]:
        kwargs["config_precisions"] = ConfigPrecisionType.FP32
    if options["share_tied_weights"]:
        return [SharedTablePartitioner(**kwargs)]
    return [FastDecompositionPartitioner(**kwargs)]
