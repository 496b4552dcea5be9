"""Read the Vulkan graphs a `.pte` carries, on any OS.

A Vulkan delegate's processed bytes hold a header, a ``VkGraph`` flatbuffer and the
constant data. ExecuTorch's Vulkan serialisation module decodes the flatbuffer (with
``flatc``), which gives the operators the GPU will run: :func:`vk_operators` counts them,
e.g. ``aten._weight_int8pack_mm.default`` for int8-weight linear layers or
``sdpa_with_kv_cache.default`` for the fused attention with cache.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Union

RUNTIME_ID = "VulkanBackend"


def vk_graphs(pte: Union[bytes, Path, str]) -> list:
    """The decoded ``VkGraph`` of every Vulkan delegate, in program order."""
    from llmcore_vulkan.partition import quiet_import

    quiet_import()
    from executorch.backends.vulkan.serialization.vulkan_graph_serialize import (
        extract_vk_flatbuffer,
        flatbuffer_to_vk_graph,
    )
    from llmcore.testing.payloads import delegate_payloads

    return [
        flatbuffer_to_vk_graph(extract_vk_flatbuffer(data))
        for backend_id, data in delegate_payloads(pte)
        if backend_id == RUNTIME_ID
    ]


def vk_operators(pte: Union[bytes, Path, str]) -> Counter:
    """How many times each operator appears in the Vulkan graphs of a program."""
    counts: Counter = Counter()
    for graph in vk_graphs(pte):
        counts.update(op.name for op in graph.chain)
    return counts
