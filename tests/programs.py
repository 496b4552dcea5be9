"""Programs that tests build ahead of time for what this runtime cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest


def vulkan_program(path: Path) -> Path:
    """Write a tiny static-shape program lowered for Vulkan to ``path``: the wheel can write it
    on Linux, but its runtime has no VulkanBackend to run it. Skips the test where the wheel
    has no Vulkan partitioner."""
    import torch

    partitioner = pytest.importorskip("executorch.backends.vulkan.partitioner.vulkan_partitioner")
    from executorch.exir import to_edge_transform_and_lower

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.linear(x)) + 1.0

    exported = torch.export.export(Tiny().eval(), (torch.randn(2, 8),))
    edge = to_edge_transform_and_lower(exported, partitioner=[partitioner.VulkanPartitioner()])
    path.write_bytes(edge.to_executorch().buffer)
    return path
