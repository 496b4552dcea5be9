"""Finding the repeated blocks that lowering converts once (llmcore.pipeline.repeated).

The end-to-end authority (the `.pte` equals the whole-graph lowering byte for byte) is in
plugins/xnnpack/tests/test_lowering.py. Here: which programs count as repeated blocks, and
that the program cut down to two blocks computes what a two-block model computes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmcore.pipeline import repeated


class Block(nn.Module):
    def __init__(self, width: int, extra: bool = False):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.extra = extra

    def forward(self, x):
        h = torch.relu(self.up(x))
        if self.extra:
            h = torch.sigmoid(h)
        return x + self.down(h)


class Stack(nn.Module):
    def __init__(self, n: int = 4, width: int = 8, odd_block: int = -1, skip_from: int = -1):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width, extra=(i == odd_block)) for i in range(n))
        self.head = nn.Linear(width, 3)
        self.skip_from = skip_from

    def forward(self, x):
        h = self.embed(x)
        kept = None
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i == self.skip_from:
                kept = h
        if kept is not None:
            h = h + kept
        return self.head(h)


def _export(module: nn.Module, x: torch.Tensor):
    seq = torch.export.Dim("seq", min=2, max=16)
    return torch.export.export(module, (x,), dynamic_shapes=({0: seq},), strict=False)


def test_finds_identical_blocks_in_order():
    ep = _export(Stack(n=5), torch.randn(4, 8))
    blocks = repeated.find_blocks(ep)
    assert blocks.prefix == "layers"
    assert len(blocks.nodes) == 5
    assert len({len(nodes) for nodes in blocks.nodes}) == 1


@pytest.mark.parametrize(
    "module,reason",
    [
        (Stack(n=4, odd_block=2), "layers.2 is not the same graph as layers.1"),
        (Stack(n=4, skip_from=1), "layers.1 is read by"),
        (Stack(n=2), "2 blocks, not 3 or more"),
    ],
)
def test_refuses_blocks_that_are_not_copies(module, reason):
    with pytest.raises(repeated.NotRepeated, match=reason):
        repeated.find_blocks(_export(module, torch.randn(4, 8)))


def test_two_block_program_computes_the_first_two_blocks():
    """The cut keeps blocks 0 and 1 and feeds block 1 to the postlude: the same function as
    the model with only its first two layers."""
    model = Stack(n=5).eval()
    x = torch.randn(6, 8)
    ep = _export(model, x)
    template = repeated.first_two_blocks(ep, repeated.find_blocks(ep))
    two = Stack(n=5).eval()
    two.layers = nn.ModuleList(list(model.layers)[:2])
    torch.testing.assert_close(template.module()(x), two(x), rtol=0, atol=0)
    kept = {spec.target for spec in template.graph_signature.input_specs if spec.target}
    assert not any(t.startswith(("layers.2.", "layers.3.", "layers.4.")) for t in kept)
    assert "layers.1.up.weight" in kept
