"""GPT-2's layers on the kernels (llmcore::int4_layer_norm_linear, int4_linear_bias_add,
int4_layer_norm_ffn_add): a whole pre-LayerNorm block against the nanoGPT block it replaces
(llmcore-nanogpt's ``Block`` with the same int4 or int8 linears, eager PyTorch), each operator
against the module parts it fuses, the blocks the rewrite refuses, and a default export whose
program runs its layers on them in Python and llmcore_runner alike."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmcore.modules import CausalAttention

PROMPT = "Hello there, world"


def gpt2_block(seed: int = 0, n_embd: int = 64, n_head: int = 4, bias: bool = True, offsets: bool = False,
               int8: bool = False, split: bool = True) -> nn.Module:
    """A llmcore-nanogpt ``Block`` (random weights, biases and norms away from 0 and 1) whose
    projections are BlockInt4Linear of blocks of 32 (``offsets``: with per-block offsets, as a
    GGUF's Q4_1) or ChannelInt8Linear (``int8``), c_attn split into q, k and v (``split``, as the
    family's source transform leaves it) or fused, and a plain causal attention."""
    from llmcore_nanogpt.model import Block, GPTConfig, SplitQKV
    from llmcore_xnnpack import qlinear

    torch.manual_seed(seed)
    block = Block(GPTConfig(block_size=128, vocab_size=64, n_layer=1, n_head=n_head, n_embd=n_embd, bias=bias))
    with torch.no_grad():
        for norm in (block.ln_1, block.ln_2):
            norm.weight.uniform_(0.5, 1.5)
            if norm.bias is not None:
                norm.bias.normal_(0.0, 0.2)
    if split:
        block.attn.c_attn = SplitQKV(block.attn.c_attn)
    parents = [(block.attn, "c_proj"), (block.mlp, "c_fc"), (block.mlp, "c_proj")]
    parents += [(block.attn.c_attn, n) for n in ("q", "k", "v")] if split else [(block.attn, "c_attn")]
    for parent, name in parents:
        linear = getattr(parent, name)
        weight = torch.randn_like(linear.weight) * 0.1
        b = None if linear.bias is None else torch.randn_like(linear.bias) * 0.5
        if int8:
            new = qlinear.ChannelInt8Linear(*qlinear.int8_channels(weight), bias=b)
        elif offsets:
            q, scales, block_offsets = qlinear.int4_blocks_affine(weight + 0.05, 32)
            new = qlinear.BlockInt4Linear(q, scales, block_offsets, bias=b)
        else:
            new = qlinear.BlockInt4Linear(*qlinear.int4_blocks(weight, 32), None, bias=b)
        setattr(parent, name, new)
    return block


@pytest.fixture(scope="module")
def ops(kernel_library):
    from llmcore_kernels import ops

    return ops


def relative(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor) -> float:
    """||got - want|| / ||want - base||: the error on what the operator adds to ``base``."""
    return float((got - want).norm() / (want - base).norm())


# dim 64 (4 heads of 16); 480 (5 heads of 96: block groups 8+4+2+1); without biases; fused
# c_attn; blocks with offsets (a GGUF's Q4_1); int8 rows (8da8w's)
@pytest.mark.parametrize("config", [{}, {"n_embd": 480, "n_head": 5}, {"bias": False}, {"split": False},
                                    {"offsets": True}, {"offsets": True, "n_embd": 480, "n_head": 5},
                                    {"int8": True}, {"int8": True, "n_embd": 480, "n_head": 5, "split": False}])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_gpt2_layer_on_the_kernels_computes_what_its_block_computes(ops, rows, config):
    from llmcore_kernels.layernorm_layers import KernelLayerNormBlock
    from llmcore_kernels.mlp import computing_as_the_kernels

    block = gpt2_block(**config)
    layer = KernelLayerNormBlock(block)
    dim = block.ln_1.weight.shape[0]
    x = torch.randn(1, rows, dim, generator=torch.Generator().manual_seed(rows))
    x[0, 0, 0] = 20.0  # an outlier sets its token's mean and spread
    with torch.no_grad(), computing_as_the_kernels(block):
        want, got = block(x, None), layer(x, None)
    # The same integers and int8 roundings; the LayerNorm rounds in C++ as PyTorch does not
    # quite, and a normed value an ulp from an int8 boundary may round to the other step.
    assert relative(got, want, x) < 0.01
    with torch.no_grad(), computing_as_the_kernels(block):
        # each operator's .out variant (what the program calls) against the module parts it fuses
        y = torch.empty(0)
        torch.ops.llmcore.int4_layer_norm_linear.out(x, layer.ln_1, layer.ln_1_bias, layer.ln_1_eps,
                                                     *layer._projection("qkv"), out=y)
        normed = block.ln_1(x)
        qkv = block.attn.c_attn(normed)
        y_want = torch.cat(qkv, dim=-1) if isinstance(qkv, tuple) else qkv
        assert y.shape == y_want.shape and float((y - y_want).norm() / y_want.norm()) < 0.01
        a = torch.randn(1, rows, dim, generator=torch.Generator().manual_seed(7))
        out = torch.empty(0)
        torch.ops.llmcore.int4_linear_bias_add.out(a, *layer._projection("wo"), x, out=out)
        assert relative(out, x + block.attn.c_proj(a), x) < 0.01
        out = torch.empty(0)
        torch.ops.llmcore.int4_layer_norm_ffn_add.out(x, layer.ln_2, layer.ln_2_bias, layer.ln_2_eps,
                                                      *layer._projection("up"), *layer._projection("down"),
                                                      layer.activation, out=out)
        assert relative(out, x + block.mlp(block.ln_2(x)), x) < 0.01


def test_the_operators_check_their_inputs(ops):
    from llmcore_kernels.layernorm_layers import KernelLayerNormBlock

    layer = KernelLayerNormBlock(gpt2_block())
    x = torch.randn(1, 3, 64)
    up, down = layer._projection("up"), layer._projection("down")
    with pytest.raises(RuntimeError, match="int4_layer_norm_ffn_add: activation must be"):
        torch.ops.llmcore.int4_layer_norm_ffn_add(x, layer.ln_2, layer.ln_2_bias, 1e-5, *up, *down, "relu")
    with pytest.raises(RuntimeError, match="int4_layer_norm_ffn_add: down must map the hidden size back"):
        torch.ops.llmcore.int4_layer_norm_ffn_add(x, layer.ln_2, layer.ln_2_bias, 1e-5, *up, *up, "gelu_tanh")
    with pytest.raises(RuntimeError, match="int4_layer_norm_linear: up_bias|int4_layer_norm_linear: w_bias"):
        w, scales, sums, _, offsets = layer._projection("qkv")
        torch.ops.llmcore.int4_layer_norm_linear(x, layer.ln_1, None, 1e-5, w, scales, sums, torch.zeros(5), offsets)
    with pytest.raises(RuntimeError, match="int4_layer_norm_linear: eps must be finite"):
        torch.ops.llmcore.int4_layer_norm_linear(x, layer.ln_1, None, -1.0, *layer._projection("qkv"))


@pytest.mark.parametrize("make, reason", [
    (lambda b: setattr(b.mlp, "activation", torch.nn.functional.gelu), "activation is gelu"),
    (lambda b: setattr(b, "ln_2", nn.Identity()), "ln_2 is a Identity"),
    (lambda b: setattr(b.attn, "c_proj", nn.Linear(64, 64)), "c_proj is a Linear"),
    (lambda b: setattr(b.attn.c_attn.k, "bias", None), "only some of q, k and v have a bias"),
], ids=["exact-gelu", "no-norm", "float-linear", "partial-bias"])
def test_the_rewrite_keeps_blocks_the_kernels_cannot_run(ops, make, reason):
    from llmcore_kernels import layers

    model = nn.ModuleList([gpt2_block()])
    make(model[0])
    swapped, kept = layers.swap_layers(model)
    assert swapped == 0 and len(kept) == 1 and reason in kept[0], kept


def test_the_swap_check_catches_a_block_that_computes_something_else(ops):
    """A block whose forward differs from GPT-2's (no residual on the MLP) passes every
    structural check; the numerical one keeps it."""
    from llmcore_kernels import layers

    block = gpt2_block()
    block.forward = lambda x, input_pos: x + block.attn(block.ln_1(x), input_pos)  # the MLP left out
    swapped, kept = layers.swap_layers(nn.ModuleList([block]))
    assert swapped == 0 and "differs from the kernels" in kept[0], kept


@pytest.mark.parametrize("view", ["avxvnni", "avx2", "sse4"])
def test_a_gpt2_layer_computes_its_block_in_every_isa_view(kernel_library, passes_in_isa_view, view):
    """The GELU on up's columns has an AVX2 path and a portable one (int4_mlp.cpp's activate):
    the layer tests again in a process whose kernels see only the view's instruction sets."""
    passes_in_isa_view(view, __file__, "gpt2_layer_on_the_kernels")


@pytest.fixture(scope="module")
def gpt2_export(kernel_library, tmp_path_factory):
    """nanoGPT's tiny GPT-2, --quantize 8da4w with the default backends (kernels, xnnpack)."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    out = tmp_path_factory.mktemp("gpt2") / "tiny.pte"
    options = ExportOptions(model="nanogpt", config="tiny", quantize="8da4w", output=str(out), quiet=True)
    return export(options, load_registry())


def test_a_default_export_runs_gpt2_layers_on_the_kernels(gpt2_export):
    from llmcore.runtime import libraries

    ops = set(libraries.program_operators(gpt2_export.pte.read_bytes()))
    assert {"llmcore::int4_layer_norm_linear.out", "llmcore::int4_linear_bias_add.out",
            "llmcore::int4_layer_norm_ffn_add.out", "llmcore::int4_linear.out"} <= ops
    taken = [entry for entry in gpt2_export.report["taken"] if entry["backend"] == "kernels"][0]
    assert {"transformer.h.0", "transformer.h.1", "lm_head"} <= set(taken["taken"]) and not taken["left"], taken
    parity = gpt2_export.report["parity"]
    assert parity["top1_agreement"] == 1.0 and parity["max_abs_diff"] < 0.05, parity


def test_python_and_the_runner_pick_the_same_gpt2_tokens(gpt2_export, runner):
    from llmcore.runtime import agreement

    (result,) = agreement.check(gpt2_export.pte, runner, PROMPT, 24)
    assert result.agrees and len(result.gaps) == 24, result.line()
