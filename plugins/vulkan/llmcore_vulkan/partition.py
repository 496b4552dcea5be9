"""The Vulkan partitioner llmcore uses: ExecuTorch's operator support, two extra rules.

ExecuTorch's ``VulkanPartitioner`` decides per node whether the Vulkan delegate has an
implementation for it. llmcore keeps that decision (``VulkanSupportedOperators``) and
builds the partitions itself, so that it can add two rules that its programs need:

* **The position arithmetic stays on the CPU.** With a KV cache, llmcore's models read
  ``input_pos[0].item()`` (an unbacked symbol), assert its range, and take rows
  ``[start, start + T)`` of their position tables (RoPE cos/sin, position embeddings).
  When such a slice lands in a different Vulkan partition than the ``item()`` that made
  its start (Llama: the RoPE ``cat``, which Vulkan does not take in 5-D, splits the
  graph), the Vulkan preprocessing re-traces the partition without the ``start >= 0``
  facts and fails (``FuseBatchNormPass``: cannot guard ``start_val < 0``); when the
  asserts go into a delegate instead, ``to_executorch`` fails the same way on the slice
  left outside. So ``item()``, the integer expressions and asserts on it, the ``select``
  that only feeds it and the slices that start there all run on the CPU (reading one
  integer back from the GPU would be a round trip anyway); the delegates receive the
  position as a symbolic integer and the table rows as a tensor. Custom ops that take the
  position (``llama::update_cache``, ``llama::custom_sdpa``) stay in Vulkan.
* **A partition must hand a tensor on.** A partition whose outputs are only symbolic
  integers (``sym_size``, ``item()`` of ``input_pos``) has no output tensor to plan, and
  the Vulkan preprocessing asserts (``graph_output_allocated not set``); such partitions
  are dropped and their few scalar operations run on the CPU.

The heavy ExecuTorch imports happen in :func:`make_partitioner` only.
"""

from __future__ import annotations

import logging
from typing import Any


def quiet_import():
    """Import ExecuTorch's Vulkan modules without their side effect on logging: the
    partitioner, the graph builder and a pass each set the *root* logger to INFO at
    import, which would print every operator the partitioner skips and every partition's
    contents. The root level is put back as it was."""
    root = logging.getLogger()
    level = root.level
    try:
        from executorch.backends.vulkan import vulkan_preprocess  # noqa: F401 (builder, passes)
        from executorch.backends.vulkan.partitioner import vulkan_partitioner
    finally:
        root.setLevel(level)
    return vulkan_partitioner


def _unbacked(value) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return bool(free_unbacked_symbols(value))
    except Exception:
        return False


def stays_on_cpu(node) -> bool:
    """Nodes of the data-dependent position arithmetic: ``input_pos[0].item()``, the
    integer expressions and runtime asserts built on it, and slices that start there.

    Custom ops that take the position as an argument (``llama::update_cache``,
    ``llama::custom_sdpa``) are not among them: Vulkan implements those.
    """
    import torch

    if node.op != "call_function":
        return False
    if "slice" in str(node.target):
        bounds = list(node.args[2:4]) + [node.kwargs.get("start"), node.kwargs.get("end")]
        return any(isinstance(b, torch.fx.Node) and _unbacked(b.meta.get("val")) for b in bounds)
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) and _unbacked(value):
        return True  # item(), u0 >= 0, s0 + u0, ...
    if "_assert_scalar" in str(node.target):
        return any(isinstance(a, torch.fx.Node) and _unbacked(a.meta.get("val")) for a in node.args)
    if node.users and all("_local_scalar_dense" in str(u.target) for u in node.users):
        return True  # input_pos[0], read back only by item(): a GPU round trip for one integer
    return False


def gives_tensor(nodes) -> bool:
    """Whether a set of nodes hands at least one tensor to the rest of the graph (a
    delegate whose outputs are only symbolic ints cannot be memory-planned)."""
    from executorch.backends.vulkan import utils as vk_utils

    inside = set(nodes)
    for node in nodes:
        leaves = any(user not in inside for user in node.users)
        if leaves and node.op == "call_function" and vk_utils.is_tensor_node(node):
            return True
    return False


def make_partitioner(compile_options: dict[str, Any], *, cpu_positions: bool = True):
    """An ExecuTorch ``Partitioner`` for the Vulkan delegate with llmcore's rules."""
    vk = quiet_import()  # first: any import of executorch.backends.vulkan sets the root level
    import executorch.backends.vulkan.patterns as vk_patterns
    from executorch.backends.vulkan import utils as vk_utils
    from executorch.exir.backend.partitioner import Partitioner, PartitionResult
    from executorch.exir.backend.utils import tag_constant_data, tag_mutated_buffer
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    class _Support(OperatorSupportBase):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def is_node_supported(self, submodules, node) -> bool:
            if cpu_positions and stays_on_cpu(node):
                return False
            return self.inner.is_node_supported(submodules, node)

    class LlmcoreVulkanPartitioner(Partitioner):
        """Vulkan's operator support; position arithmetic stays out; no tensor-less partitions."""

        def __init__(self) -> None:
            inner = vk.VulkanPartitioner(compile_options)
            self.delegation_spec = inner.delegation_spec
            self._inner = inner
            super().__init__(spec={})

        def ops_to_not_decompose(self, ep):
            return self._inner.ops_to_not_decompose(ep)

        def partition(self, ep) -> PartitionResult:
            gm = ep.graph_module
            options = compile_options
            if "texture_limits" in options:
                limits = options["texture_limits"]
            elif options.get("small_texture_limits", False):
                limits = vk_utils.SMALL_TEXTURE_LIMITS
            else:
                limits = vk_utils.DEFAULT_TEXTURE_LIMITS
            support = vk.VulkanSupportedOperators(
                limits,
                options.get("buffer_limit", vk_utils.DEFAULT_BUFFER_LIMIT),
                require_dynamic_shape=options.get("require_dynamic_shapes", False),
                skip_bool_tensors=options.get("skip_bool_tensors", False),
                fusable_subgraphs=vk_patterns.get_all_fusable_subgraphs(gm),
            )
            proposed = CapabilityBasedPartitioner(
                gm, _Support(support), allows_single_node_partition=True
            ).propose_partitions()
            tags = {}
            for part in proposed:
                if not gives_tensor(part.nodes):
                    continue
                tag = f"vulkan{part.id}"
                for node in part.nodes:
                    node.meta["delegation_tag"] = tag
                tags[tag] = self.delegation_spec
            tag_constant_data(ep)
            tag_mutated_buffer(ep)
            return PartitionResult(tagged_exported_program=ep, partition_tags=tags)

    return LlmcoreVulkanPartitioner()
