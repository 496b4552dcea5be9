"""llmcore-xnnpack's partitioner leaves out partitions that only reshape (a delegate call that
computes nothing); authority: the lowered graph's delegate calls, and the same lowering with
the rule turned off, which delegates the reshapes."""

from __future__ import annotations

import pytest
import torch

from llmcore_xnnpack import partition


class Reshapes(torch.nn.Module):
    def forward(self, x):
        return x.view(4, 8).unsqueeze(0)


class ReshapeAndAdd(torch.nn.Module):
    def forward(self, x):
        return x.view(4, 8) + 1.0


def delegate_calls(module: torch.nn.Module) -> int:
    from executorch.exir import to_edge_transform_and_lower

    program = torch.export.export(module, (torch.randn(32),))
    edge = to_edge_transform_and_lower(program, partitioner=[partition.FastDecompositionPartitioner()])
    return sum(1 for n in edge.exported_program().graph.nodes
               if n.op == "call_function" and "executorch_call_delegate" in str(n.target))


@pytest.mark.parametrize("rule", [True, False])
def test_a_partition_of_reshapes_alone_is_left_to_the_runtime(monkeypatch, rule):
    if not rule:
        monkeypatch.setattr(partition, "_SHAPE_ONLY", frozenset())
    assert delegate_calls(Reshapes()) == (0 if rule else 1)
    assert delegate_calls(ReshapeAndAdd()) == 1  # a partition that computes keeps its reshapes
