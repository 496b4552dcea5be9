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


@torch.library.custom_op("llmcore_test::held_linear", mutates_args=())
def held_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x + x W, W held as integers in any form (as the kernels' operators take a weight)."""
    return x + x @ w.to(torch.float32).reshape(x.shape[-1], x.shape[-1])


@held_linear.register_fake
def _(x, w):
    return torch.empty_like(x)


class HeldBlock(nn.Module):
    """A block whose weight is held as integers, ``dtype`` and ``shape`` its form: blocks of
    other forms compute outputs of the same shape and type (as an int4 or int8 layer's
    operator does), so only the weights tell them apart."""

    def __init__(self, dtype: torch.dtype, shape: tuple):
        super().__init__()
        self.register_buffer("w", torch.randint(0, 8, shape).to(dtype))

    def forward(self, x):
        return held_linear(x, self.w)


@pytest.mark.parametrize("odd_form", [(torch.uint8, (8, 8)), (torch.int8, (64,))], ids=["dtype", "shape"])
def test_blocks_whose_weights_differ_in_form_are_not_copies(odd_form):
    """A copy takes its template's tensor specs: a block whose weight has another type or
    shape (a Q4_K_S GGUF's layers: Q4_K nibbles in one, int8 rows in the next) copied from
    one of another form failed at emit ("Tensor spec has buffer of size ..."), or would
    read its bytes as the template's type."""
    model = Stack(n=4)
    model.layers = nn.ModuleList(HeldBlock(*(odd_form if i == 2 else (torch.int8, (8, 8)))) for i in range(4))
    # the reason names the operator and the argument that differ (the log line of lower.py)
    with pytest.raises(repeated.NotRepeated, match=r"layers.2 is not the same graph as layers.1 "
                       r"\(llmcore_test.held_linear.default's argument 1: \('weight', 'w'"):
        repeated.find_blocks(_export(model, torch.randn(4, 8)))
    model.layers[2] = HeldBlock(torch.int8, (8, 8))
    assert len(repeated.find_blocks(_export(model, torch.randn(4, 8))).nodes) == 4


def test_two_block_program_computes_the_first_two_blocks():
    """The cut keeps blocks 0 and 1 and feeds block 1 to the postlude: the same function as
    the model with only its first two layers."""
    model = Stack(n=5).eval()
    x = torch.randn(6, 8)
    ep = _export(model, x)
    template = repeated.first_blocks(ep, repeated.find_blocks(ep))
    two = Stack(n=5).eval()
    two.layers = nn.ModuleList(list(model.layers)[:2])
    torch.testing.assert_close(template.module()(x), two(x), rtol=0, atol=0)
    kept = {spec.target for spec in template.graph_signature.input_specs if spec.target}
    assert not any(t.startswith(("layers.2.", "layers.3.", "layers.4.")) for t in kept)
    assert "layers.1.up.weight" in kept


def _pt2e_quantized(module: nn.Module, x: torch.Tensor):
    """``module`` quantized as the int8-dynamic recipe does (pt2e, XNNPACK's dynamic config),
    exported again: its quantize/dequantize nodes belong to no module, and the weights'
    dequantize nodes sit at the top of the graph with scales named ``_scale_N``."""
    pytest.importorskip("executorch.backends.xnnpack.quantizer.xnnpack_quantizer")
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    ep = _export(module, x)
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True))
    prepared = prepare_pt2e(ep.module(), quantizer)
    prepared(x)
    return _export(convert_pt2e(prepared), x)


def test_pt2e_nodes_are_gathered_into_their_blocks():
    """Before: the weights' dequantize nodes are outside every block, so the blocks are not
    contiguous. After gathering, each block is one run, its scales are its local tensors
    (block k's j-th is block 1's j-th), the blocks compare equal, and the program computes
    exactly what it computed."""
    class NormBlock(Block):  # as a decoder layer: its linears read a norm of its input
        def __init__(self, width: int):
            super().__init__(width)
            self.norm = nn.LayerNorm(width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    stack = Stack(n=4)
    stack.layers = nn.ModuleList(NormBlock(8) for _ in range(4))
    x = torch.randn(4, 8)
    ep = _pt2e_quantized(stack, x)
    before = ep.module()(x)
    with pytest.raises(repeated.NotRepeated, match="interleaved"):
        repeated.find_blocks(ep)
    assert repeated.gather_block_nodes(ep) > 0
    blocks = repeated.find_blocks(ep)
    assert len(blocks.nodes) == 4
    assert blocks.local[1] and len({len(local) for local in blocks.local[1:]}) == 1
    assert not set(blocks.local[1]) & set(blocks.local[2])
    assert any(t.startswith("_scale_") for t in blocks.local[1])
    torch.testing.assert_close(ep.module()(x), before, rtol=0, atol=0)
    assert repeated.gather_block_nodes(ep) == 0  # nothing left to gather


def test_nodes_reading_the_prelude_stay_there():
    """A node no module claims whose users are all in block 0 but which reads the prelude
    (an embedding's output) is not moved into block 0: the blocks keep comparing equal."""

    class Prelude(Stack):
        def forward(self, x):
            h = self.embed(x) * 2.0  # no module claims the multiply; only block 0 reads it
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    ep = _export(Prelude(n=4), torch.randn(4, 8))
    repeated.gather_block_nodes(ep)
    blocks = repeated.find_blocks(ep)
    assert all("mul" not in str(n.target) for n in blocks.nodes[0])


def test_gathering_keeps_a_node_whose_users_stay_outside():
    """A node no module claims that reads only a parameter, used by one that reads the
    prelude, used in turn by a block: the second stays out (it reads the prelude), so the
    first must too (its user is not in the block). The program still computes the same."""

    class Gains(Stack):
        def __init__(self):
            super().__init__(n=4)
            self.gain = nn.Parameter(torch.ones(8))

        def forward(self, x):
            pre = self.embed(x)
            h = pre
            for layer in self.layers:
                g = (self.gain * 2.0) + pre.mean()  # unclaimed: a parameter, then the prelude
                h = layer(h * g)
            return self.head(h)

    x = torch.randn(4, 8)
    ep = _export(Gains(), x)
    before = ep.module()(x)
    repeated.gather_block_nodes(ep)
    ep.graph.lint()
    torch.testing.assert_close(ep.module()(x), before, rtol=0, atol=0)
