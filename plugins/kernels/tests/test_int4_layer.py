"""The 8da4w-layers and 8da8w-layers recipes and their operators (llmcore::int4_norm_qkv_rope, int4_linear_add,
int4_norm_mlp_add, and int4_linear for the output layer): a whole Llama layer on the kernels against the Llama module it replaces
(llmcore-llama's TransformerBlock with the same int4 or int8 linears, eager PyTorch), the layers the
rewrite refuses, and a program that runs in Python and llmcore_runner alike."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from llmcore.errors import LlmcoreError
from llmcore.modules import CausalAttention

PROMPT = "Hello there, world"


def q4_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, d)`` of ``weight`` rounded as llama.cpp's Q4_0 writer rounds it: each block's scale
    ``d = max / -8`` (``max`` its value of largest magnitude), negative for about half the
    blocks, ``q`` in [-8, 7]."""
    blocks = weight.view(weight.shape[0], -1, 32)
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    d = (largest / -8).to(torch.bfloat16).float()  # the recipes' bf16 scales
    q = torch.round(blocks / d).clamp(-8, 7).to(torch.int8)
    return q.view(weight.shape), d.squeeze(-1)


def int4_block(seed: int = 0, offsets: bool = False, int8: bool = False, q4_0: bool = False, v_int8: bool = False,
               **config):
    """A llmcore-llama TransformerBlock (random weights) with every projection a BlockInt4Linear
    of blocks of 32, as 8da4w leaves it (``offsets``: with per-block offsets, as a GGUF's Q4_1
    or 8da4w's asymmetric=true; ``q4_0``: a Q4_0 file's signed scales, :func:`q4_0_blocks`;
    ``int8``: a ChannelInt8Linear instead, as 8da8w leaves it; ``v_int8``: wv alone a
    ChannelInt8Linear, as a Q4_K_M GGUF's Q6_K v beside Q4_K q and k), and a plain causal
    attention."""
    from llmcore_llama.config import LlamaConfig
    from llmcore_llama.model import TransformerBlock
    from llmcore_xnnpack import qlinear

    base = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=320, hidden_dim=192, max_seq_len=128)
    cfg = LlamaConfig(**{**base, **config})
    torch.manual_seed(seed)
    block = TransformerBlock(cfg)
    with torch.no_grad():
        for norm in (block.attention_norm, block.ffn_norm, block.attention_post_norm, block.ffn_post_norm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    for parent, names in ((block.attention, ("wq", "wk", "wv", "wo")), (block.feed_forward, ("w1", "w3", "w2"))):
        for name in names:
            linear = getattr(parent, name)
            weight = torch.randn_like(linear.weight) * 0.1
            bias = None if linear.bias is None else torch.randn_like(linear.bias) * 0.5
            if int8 or (v_int8 and name == "wv"):
                setattr(parent, name, qlinear.ChannelInt8Linear(*qlinear.int8_channels(weight), bias=bias))
                continue
            if offsets:
                q, scales, block_offsets = qlinear.int4_blocks_affine(weight + 0.05, 32)
            elif q4_0:
                (q, scales), block_offsets = q4_0_blocks(weight), None
            else:
                (q, scales), block_offsets = qlinear.int4_blocks(weight, 32), None
            setattr(parent, name, qlinear.BlockInt4Linear(q, scales, block_offsets, bias=bias))
    return block


def rope_tables(rows: int, head_dim: int, seed: int = 1):
    """cos, sin ``[1, rows, 1, head_dim]`` of random angles, each repeated for its channel pair."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(1, rows, 1, head_dim // 2, generator=g).repeat_interleave(2, dim=-1) * 6.0
    return angles.cos(), angles.sin()


@pytest.fixture(scope="module")
def ops(kernel_library):
    from llmcore_kernels import ops

    return ops


# A v of another kind than q and k, its own projection in the same operator: a Q4_K_M GGUF's
# (Q4_K q and k with offsets, a Q6_K v as int8 rows), with biases (a Qwen2.5 Q4_K_M), 480 wide
V_APART = [pytest.param({"offsets": True, "v_int8": True}, id="v_apart_q4_k_m"),
           pytest.param({"v_int8": True, "qkv_bias": True, "dim": 480, "n_heads": 5, "n_kv_heads": 1,
                         "hidden_dim": 288}, id="v_apart_biases_480")]


# dim 64: one group of 2 blocks; 480: groups 8+4+2+1 (head_dim 96, one kv head); q/k/v biases
# (Qwen2's); blocks with offsets (a GGUF's Q4_1); int8 rows (8da8w's); v apart (V_APART)
@pytest.mark.parametrize("config", [{}, {"dim": 480, "n_heads": 5, "n_kv_heads": 1, "hidden_dim": 288},
                                    {"qkv_bias": True}, {"offsets": True},
                                    {"offsets": True, "dim": 480, "n_heads": 5, "n_kv_heads": 1, "hidden_dim": 288},
                                    {"int8": True}, {"int8": True, "qkv_bias": True},
                                    {"int8": True, "dim": 480, "n_heads": 5, "n_kv_heads": 1, "hidden_dim": 288},
                                    {"q4_0": True},
                                    {"q4_0": True, "qkv_bias": True, "dim": 480, "n_heads": 5, "n_kv_heads": 1,
                                     "hidden_dim": 288}] + V_APART)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_layer_on_the_kernels_computes_what_the_llama_block_computes(ops, rows, config):
    """The block in the kernels' own form (a Q4_0's negative scales as they are:
    mlp.computing_as_the_kernels) against the kernel layer; the same function checked below for
    a block the module's form and the kernels' compute alike."""
    from llmcore_kernels import mlp
    from llmcore_kernels.layers import KernelLayer

    block = int4_block(**config)
    layer = KernelLayer(block)
    assert layer.v_apart == bool(config.get("v_int8")) and (layer.wv is None) != layer.v_apart
    if config.get("q4_0"):  # every block without an offset: the negative scales are the kernels' again
        assert all(getattr(layer, f"{n}_offsets") is None for n in ("qkv", "wo", "gate_up", "down"))
        assert float(layer.qkv_scales.float().min()) < 0
    dim, head_dim = block.attention.wq.in_features, block.attention.head_dim
    x = torch.randn(1, rows, dim, generator=torch.Generator().manual_seed(rows))
    x[0, 0, 0] = 20.0  # an outlier sets its token's int8 scale
    cos, sin = rope_tables(rows, head_dim)
    with torch.no_grad(), mlp.computing_as_the_kernels(block):
        want, got = block(x, cos, sin), layer(x, cos, sin)
    # The same integers and roundings; a normed value an ulp away from an int8 rounding boundary
    # may round to the other step (the kernels norm in C++), which then passes through
    # attention and the MLP. Measured: 1e-7 to 4e-7, and 6.6e-4 for 64 rows of 480.
    error = float((got - want).norm() / (want - x).norm())
    assert error < 0.01, error
    # q, k, v through the .out variant the program calls, against the block's own projections
    q, k, v = torch.empty(0), torch.empty(0), torch.empty(0)
    torch.ops.llmcore.int4_norm_qkv_rope.out(
        x, layer.attention_norm, layer.attention_eps, layer.qkv, layer.qkv_scales, layer.qkv_sums, layer.qkv_bias,
        layer.qkv_offsets, cos, sin, layer.n_heads, layer.n_kv_heads, layer.wv, layer.wv_scales, layer.wv_sums,
        layer.wv_offsets, q=q, k=k, v=v)
    assert q.shape == (1, rows, layer.n_heads, head_dim) and k.shape == v.shape == (1, rows, layer.n_kv_heads, head_dim)
    with torch.no_grad(), mlp.computing_as_the_kernels(block):
        normed = block.attention_norm(x)
        q_want, k_want, v_want = [proj(normed).view(1, rows, -1, head_dim) for proj in
                                  (block.attention.wq, block.attention.wk, block.attention.wv)]

    def rotate(y):  # Meta's interleaved channel pairs (int4_layer.h)
        out = torch.empty_like(y)
        out[..., 0::2] = y[..., 0::2] * cos[..., 0::2] - y[..., 1::2] * sin[..., 0::2]
        out[..., 1::2] = y[..., 1::2] * cos[..., 1::2] + y[..., 0::2] * sin[..., 1::2]
        return out

    for got_part, want_part in ((q, rotate(q_want)), (k, rotate(k_want)), (v, v_want)):
        assert float((got_part - want_part).norm() / want_part.norm()) < 0.01


# Gemma's layers: sandwich norms (a norm on the attention's and on the MLP's output, before
# each residual add), a GeGLU MLP, each alone and together, with q/k norms (Gemma 3's), offsets
# (a GGUF's Q4_1) and int8 rows
@pytest.mark.parametrize("config", [{"sandwich_norms": True}, {"ffn_activation": "gelu_tanh"},
                                    {"sandwich_norms": True, "ffn_activation": "gelu_tanh"},
                                    {"sandwich_norms": True, "ffn_activation": "gelu_tanh", "qk_norm": True},
                                    {"sandwich_norms": True, "ffn_activation": "gelu_tanh", "offsets": True},
                                    {"sandwich_norms": True, "ffn_activation": "gelu_tanh", "int8": True,
                                     "dim": 480, "n_heads": 5, "n_kv_heads": 1, "hidden_dim": 288}])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_gemma_layer_on_the_kernels_computes_what_its_block_computes(ops, rows, config):
    from llmcore_kernels import mlp
    from llmcore_kernels.layers import KernelLayer

    block = int4_block(**config)
    layer = KernelLayer(block)
    sandwich, geglu = config.get("sandwich_norms", False), config.get("ffn_activation") == "gelu_tanh"
    assert (layer.ffn_post_norm is not None) == sandwich and layer.activation == ("gelu_tanh" if geglu else "silu")
    x = torch.randn(1, rows, block.attention.wq.in_features, generator=torch.Generator().manual_seed(rows))
    x[0, 0, 0] = 20.0  # an outlier sets its token's int8 scale
    cos, sin = rope_tables(rows, block.attention.head_dim)
    with torch.no_grad(), mlp.computing_as_the_kernels(block):
        want, got = block(x, cos, sin), layer(x, cos, sin)
    error = float((got - want).norm() / (want - x).norm())
    assert error < 0.01, error
    # each new operator's .out variant gives what the layer's call gave
    h = torch.randn_like(x)
    weights = (layer.gate_up, layer.gate_up_scales, layer.gate_up_sums, layer.gate_up_offsets, layer.down,
               layer.down_scales, layer.down_sums, layer.down_offsets)
    with torch.no_grad(), mlp.computing_as_the_kernels(block):
        out = torch.empty(0)
        torch.ops.llmcore.int4_norm_glu_add.out(h, layer.ffn_norm, layer.ffn_eps, *weights, layer.activation,
                                                layer.ffn_post_norm, layer.ffn_post_norm_eps or 0.0, out=out)
        normed = block.ffn_norm(h)
        f = block.feed_forward(normed)
        mlp_want = h + (f if block.ffn_post_norm is None else block.ffn_post_norm(f))
    assert float((out - mlp_want).norm() / (mlp_want - h).norm()) < 0.01
    if sandwich:
        out = torch.empty(0)
        a = torch.randn(1, rows, block.attention.wo.in_features, generator=torch.Generator().manual_seed(7))
        torch.ops.llmcore.int4_linear_norm_add.out(a, layer.wo, layer.wo_scales, layer.wo_sums, layer.wo_offsets,
                                                   layer.attention_post_norm, layer.attention_post_norm_eps, x, out=out)
        with torch.no_grad(), mlp.computing_as_the_kernels(block):
            wo_want = x + block.attention_post_norm(block.attention.wo(a))
        assert float((out - wo_want).norm() / (wo_want - x).norm()) < 0.01



def test_the_operators_check_their_inputs(ops):
    from llmcore_kernels.layers import KernelLayer

    layer = KernelLayer(int4_block())
    x = torch.randn(1, 3, 64)
    cos, sin = rope_tables(3, 16)
    with pytest.raises(RuntimeError, match="n_heads must be a positive multiple of n_kv_heads"):
        torch.ops.llmcore.int4_norm_qkv_rope(x, layer.attention_norm, 1e-5, layer.qkv, layer.qkv_scales,
                                             layer.qkv_sums, None, None, cos, sin, 3, 2)
    with pytest.raises(RuntimeError, match="cos and sin must hold one row per token"):
        torch.ops.llmcore.int4_norm_qkv_rope(x, layer.attention_norm, 1e-5, layer.qkv, layer.qkv_scales,
                                             layer.qkv_sums, None, None, cos[:, :2], sin[:, :2], 4, 2)
    with pytest.raises(RuntimeError, match="qkv_bias's last size must be 128"):
        torch.ops.llmcore.int4_norm_qkv_rope(x, layer.attention_norm, 1e-5, layer.qkv, layer.qkv_scales,
                                             layer.qkv_sums, torch.zeros(96), None, cos, sin, 4, 2)
    with pytest.raises(RuntimeError, match=r"qkv's offsets must be a float16 \[16, 2, 8\]"):
        torch.ops.llmcore.int4_norm_qkv_rope(x, layer.attention_norm, 1e-5, layer.qkv, layer.qkv_scales,
                                             layer.qkv_sums, None, torch.zeros(2, 128), cos, sin, 4, 2)
    with pytest.raises(RuntimeError, match="residual must hold one row per row of x"):
        torch.ops.llmcore.int4_linear_add(x, layer.wo, layer.wo_scales, layer.wo_sums, None, x[:, :2])
    m = layer  # the MLP's packed buffers are the layer's
    with pytest.raises(RuntimeError, match="eps must be finite"):
        torch.ops.llmcore.int4_norm_mlp_add(x, layer.ffn_norm, float("nan"), m.gate_up, m.gate_up_scales,
                                            m.gate_up_sums, None, m.down, m.down_scales, m.down_sums, None)
    int8 = KernelLayer(int4_block(int8=True))
    assert int8.qkv.dtype == torch.int8 and int8.qkv.shape == (128, 64) and int8.qkv_scales.shape == (128,)
    with pytest.raises(RuntimeError, match="int8, Q6_K and Q4_K weights take no block offsets"):
        torch.ops.llmcore.int4_linear_add(x, int8.wo, int8.wo_scales, int8.wo_sums, torch.zeros(8, 2, 8), x)
    with pytest.raises(RuntimeError, match=r"an int8 weight's scales must be a contiguous float32 \[64\] \(one a row\) "
                                           r"or float16 \[64, 2\] \(one a block of 32\)"):
        torch.ops.llmcore.int4_linear_add(x, int8.wo, int8.wo_scales[:32], int8.wo_sums, None, x)
    with pytest.raises(RuntimeError, match=r"an int8 weight's row sums must be a contiguous float32 \[64\] tensor"):
        torch.ops.llmcore.int4_linear_add(x, int8.wo, int8.wo_scales, int8.wo_sums[:32], None, x)
    with pytest.raises(RuntimeError, match=r"or float16 \[64, 2\]"):  # int8 blocks' scales are float16
        torch.ops.llmcore.int4_linear_add(x, int8.wo, torch.ones(64, 2), int8.wo_sums, None, x)
    with pytest.raises(RuntimeError, match="int8 weights must be a contiguous .* multiple of 32"):
        torch.ops.llmcore.int4_linear_add(x[..., :48], int8.wo[:, :48], int8.wo_scales, int8.wo_sums, None, x)


def quantized_linear(kind: str, rows: int = 320, cols: int = 64, bias: bool = False):
    """A random output layer as the recipes leave it: ``int8`` per channel (8da4w's default, 8da8w),
    ``int4`` blocks of 32 (output_bits=4), ``offsets`` (blocks with offsets, a GGUF's Q4_1)."""
    from llmcore_xnnpack import qlinear

    g = torch.Generator().manual_seed(rows + cols)
    w = torch.randn(rows, cols, generator=g) * 0.1
    b = torch.randn(rows, generator=g) if bias else None
    if kind == "int8":
        return qlinear.ChannelInt8Linear(*qlinear.int8_channels(w), bias=b)
    if kind == "int4":
        return qlinear.BlockInt4Linear(*qlinear.int4_blocks(w, 32), None, bias=b)
    q, scales, offsets = qlinear.int4_blocks_affine(w + 0.05, 32)
    return qlinear.BlockInt4Linear(q, scales, offsets, bias=b)


# in 64: one group of 2 blocks; 480: groups 8+4+2+1
@pytest.mark.parametrize("kind, bias, cols", [("int8", False, 64), ("int8", True, 480), ("int4", False, 480),
                                              ("int4", True, 64), ("offsets", False, 64), ("offsets", True, 480)])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_output_layer_on_the_kernel_computes_what_its_module_computes(ops, kind, bias, cols, rows):
    from llmcore_kernels import mlp
    from llmcore_kernels.layers import KernelLinear

    linear = quantized_linear(kind, cols=cols, bias=bias)
    kernel = KernelLinear(linear)
    assert (kernel.w.dtype == torch.int8) == (kind == "int8") and (kernel.w_offsets is not None) == (kind == "offsets")
    x = torch.randn(1, rows, cols, generator=torch.Generator().manual_seed(rows))
    x[0, 0, 0] = 20.0  # an outlier sets its token's int8 scale
    with torch.no_grad(), mlp.computing_as_the_kernels(linear):
        want, got = linear(x), kernel(x)
    assert got.shape == want.shape == (1, rows, 320)
    # the same integers and int8 roundings, summed in another order (measured: 6e-8 to 1.5e-7)
    assert float((got - want).norm() / want.norm()) < 1e-5
    out = torch.empty(0)
    torch.ops.llmcore.int4_linear.out(x, kernel.w, kernel.w_scales, kernel.w_sums, kernel.w_bias, kernel.w_offsets,
                                      out=out)
    assert torch.equal(out, got)


@pytest.mark.parametrize("nibbles", [False, True])
def test_a_q4_0s_negative_scales_reach_the_kernels_as_the_file_holds_them(ops, nibbles):
    """A Q4_0 block with scale d < 0: held for XNNPACK (int8 integers) as |d| (~q) + |d|, held
    two to a byte as it is until unpack_() gives XNNPACK's form; the kernels take d and q
    (mlp.signed_form) from either: the same weights bit for bit, no offsets left. A Q4_1-like
    weight keeps its form whole, even a block whose offset equals its scale."""
    from llmcore_kernels import mlp
    from llmcore_xnnpack import qlinear

    g = torch.Generator().manual_seed(7)
    q, d = q4_0_blocks(torch.randn(96, 320, generator=g) * 0.1)
    linear = qlinear.BlockInt4Linear(q, d, nibbles=nibbles)
    want = (q.view(96, -1, 32) * d.unsqueeze(-1)).view(96, -1)
    # XNNPACK's form for int8 integers; the file's while two to a byte (scales in bfloat16)
    assert (linear.offset_weight is not None) == (not nibbles)
    assert bool((linear.scales > 0).all()) == (not nibbles)

    def weights(form):
        integers, scales, offsets = form
        integers = qlinear.unpack_nibbles(integers) if nibbles else integers
        w = integers.float().view(len(integers), -1, 32) * scales.float().unsqueeze(-1)
        if offsets is not None:
            w = w + (offsets / 32).unsqueeze(-1)
        return w.view(len(integers), -1)

    form = mlp.signed_form(linear, nibbles)
    assert form[2] is None and torch.equal(form[1].float(), d)
    assert torch.equal(weights(form), want) and torch.equal(linear.weight_values(), want)
    linear.unpack_()  # what the kernels leave goes to XNNPACK: positive scales, the same weights
    assert linear.offset_weight is not None and bool((linear.scales > 0).all()) and linear.scales.dtype == torch.float32
    assert linear.q is not None and torch.equal(linear.weight_values(), want)
    # offsets of their own (Q4_1's minima), one block's equal to its scale: the form stays whole
    q1, scales1, offsets1 = qlinear.int4_blocks_affine(torch.randn(96, 320, generator=g) * 0.1 + 0.05, 32)
    offsets1[0, 0] = scales1.to(torch.bfloat16).float()[0, 0]
    affine = qlinear.BlockInt4Linear(q1, scales1, offsets1, nibbles=nibbles)
    form = mlp.signed_form(affine, nibbles)
    assert torch.equal(form[2], affine.offset_weight) and torch.equal(form[1], affine.scales)
    assert torch.equal(weights(form), affine.weight_values())


def test_offsets_reach_the_kernels_in_float16_and_others_stay_on_xnnpack(ops):
    """The kernels store a weight's block offsets in float16, the values the module holds
    (qlinear.float16_offsets): a KernelLinear computes the module's product. A layer whose
    offsets are not float16 values (offsets of its own plus XNNPACK's |d| for a negative
    scale, after unpack_()) is refused by name, not rounded again."""
    from llmcore_kernels import mlp
    from llmcore_kernels.layers import KernelLinear
    from llmcore_xnnpack import qlinear

    g = torch.Generator().manual_seed(11)
    q, scales, offsets = qlinear.int4_blocks_affine(torch.randn(40, 96, generator=g) * 0.1 + 0.05, 32)
    linear = qlinear.BlockInt4Linear(q, scales, offsets, nibbles=True)
    kernel = KernelLinear(linear)
    assert kernel.w_offsets.dtype == torch.float16
    assert torch.equal(kernel.w_offsets.float()[:5, :, :].transpose(1, 2).reshape(40, 3), linear.offset_weight)
    x = torch.randn(3, 96, generator=g)
    with torch.no_grad(), mlp.computing_as_the_kernels(linear):
        assert qlinear.relative_error(kernel(x), linear(x)) < 1e-5
    signed = scales.clone()
    signed[0, 0] = -signed[0, 0] * 1.001  # becomes |d| (~q) + |d| beside its own offset: not a float16
    mixed = qlinear.BlockInt4Linear(q, signed, offsets)
    assert "offsets are not float16 values" in mlp.why_not_linear("linear", mixed, offsets=True)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_negative_scales_on_the_kernel_are_as_near_the_float_product_as_the_modules_form(ops, rows):
    """The kernels compute a Q4_0 weight's product with its negative scales, the module with
    |d| (~q) + |d|: the same weights, the activations' int8 rounding meeting them differently.
    Against the float product (x times the weights, no rounding) the kernel is no farther off
    than the module (measured here: 0.04-2.6% nearer; on SmolLM2's real Q4_0 linears 0.711% against
    0.720%), and it computes its own form's product to float summation order."""
    from llmcore_kernels import mlp
    from llmcore_kernels.layers import KernelLinear
    from llmcore_xnnpack import qlinear

    g = torch.Generator().manual_seed(rows)
    linear = qlinear.BlockInt4Linear(*q4_0_blocks(torch.randn(320, 480, generator=g) * 0.1))
    kernel = KernelLinear(linear)
    assert kernel.w_offsets is None
    x = torch.randn(1, rows, 480, generator=g)
    exact = x.double() @ linear.weight_values().double().T
    with torch.no_grad():
        got, module = kernel(x), linear(x)
        with mlp.computing_as_the_kernels(linear):
            own_form = linear(x)

    def off(y):
        return float((y.double() - exact).norm() / exact.norm())

    assert off(got) <= off(module) * 1.05, (off(got), off(module))
    assert float((got - own_form).norm() / own_form.norm()) < 1e-5
    assert linear.offset_weight is not None and bool((linear.scales > 0).all())  # restored


@pytest.mark.parametrize("view", ["avxvnni", "avx2", "sse4"])
def test_negative_scales_in_every_isa_view(kernel_library, passes_in_isa_view, view):
    """A block's scale meets its integer sums as a float multiply on every path: the same tests
    again in a process whose kernels see only the view's instruction sets."""
    passes_in_isa_view(view, __file__, "negative_scales_on_the_kernel or q4_0s_negative_scales")


def test_the_output_layer_operator_checks_its_inputs(ops):
    from llmcore_kernels.layers import KernelLinear

    k = KernelLinear(quantized_linear("int8"))
    x = torch.randn(1, 3, 64)
    with pytest.raises(RuntimeError, match="w_bias's last size must be 320"):
        torch.ops.llmcore.int4_linear(x, k.w, k.w_scales, k.w_sums, torch.zeros(32), None)
    with pytest.raises(RuntimeError, match="x's last size must be 64"):
        torch.ops.llmcore.int4_linear(x[..., :32], k.w, k.w_scales, k.w_sums, None, None)
    with pytest.raises(RuntimeError, match="int8, Q6_K and Q4_K weights take no block offsets"):
        torch.ops.llmcore.int4_linear(x, k.w, k.w_scales, k.w_sums, None, torch.zeros(40, 2, 8))


def test_linears_the_kernel_cannot_run_stay_with_xnnpack(ops):
    from llmcore_kernels import layers
    from llmcore_xnnpack import qlinear

    split = quantized_linear("int8")
    split.outlier_split = True
    model = torch.nn.ModuleDict({"output": quantized_linear("int8"), "split": split, "plain": torch.nn.Linear(64, 8)})
    kept = layers.swap_outside_layers(model)
    assert isinstance(model["output"], layers.KernelLinear)
    assert model["split"] is split and isinstance(model["plain"], torch.nn.Linear)
    assert kept == ["split: its linears split outliers (outlier_split=true)"]
    assert not any(isinstance(m, qlinear.ChannelInt8Linear) for m in model["output"].modules())


def exact_gelu(block):
    """The block with an exact (erf) GELU in its MLP, which the kernels do not compute."""
    block.feed_forward.activation = torch.nn.functional.gelu
    return block


def halves_rope(block):
    """The block with RoPE rotating the two halves of each head (Hugging Face's layout)
    instead of Meta's interleaved pairs: a function the kernels do not compute."""
    d = block.attention.head_dim
    p = torch.zeros(d, d)
    idx = torch.arange(d // 2)
    p[idx + d // 2, idx] = -1.0
    p[idx, idx + d // 2] = 1.0
    block.attention.pair_swap_q, block.attention.pair_swap_k = p, p.clone()
    return block


def _qkv_normed_head_by_head(layer, x, cos, sin):
    """q, k, v of a layer with q/k norms from the operators one at a time, as its programs
    ran them before int4_norm_qkv_norm_rope: the attention norm (llmcore::rms_norm), the qkv
    GEMM (llmcore::int4_linear), each q and k head normed by llmcore::rms_norm, then RoPE on
    Meta's interleaved pairs in float ops (``a cos - b sin``, ``b cos + a sin``)."""
    normed = torch.ops.llmcore.rms_norm.default(x, layer.attention_norm, layer.attention_eps)
    d, bsz = layer.head_dim, x.shape[0]
    q_width, kv_width = layer.n_heads * d, layer.n_kv_heads * d
    if layer.v_apart:  # q's and k's GEMM, then v's
        bias = (None, None) if layer.qkv_bias is None else layer.qkv_bias.split([q_width + kv_width, kv_width])
        y = torch.ops.llmcore.int4_linear.default(
            normed, layer.qkv, layer.qkv_scales, layer.qkv_sums, bias[0], layer.qkv_offsets)
        v = torch.ops.llmcore.int4_linear.default(
            normed, layer.wv, layer.wv_scales, layer.wv_sums, bias[1], layer.wv_offsets)
        q, k = y.split([q_width, kv_width], dim=-1)
    else:
        y = torch.ops.llmcore.int4_linear.default(
            normed, layer.qkv, layer.qkv_scales, layer.qkv_sums, layer.qkv_bias, layer.qkv_offsets)
        q, k, v = y.split([q_width, kv_width, kv_width], dim=-1)
    q = torch.ops.llmcore.rms_norm.default(q.reshape(bsz, -1, layer.n_heads, d), layer.q_norm, layer.qk_eps)
    k = torch.ops.llmcore.rms_norm.default(k.reshape(bsz, -1, layer.n_kv_heads, d), layer.k_norm, layer.qk_eps)

    def rotate(t):
        pairs = t.unflatten(-1, (-1, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        c, s = cos[..., 0::2], sin[..., 0::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)

    return rotate(q), rotate(k), v.reshape(bsz, -1, layer.n_kv_heads, d)


@pytest.mark.parametrize("config", [{}, {"head_dim": 32, "qkv_bias": True}, {"offsets": True}, {"int8": True},
                                    pytest.param({"head_dim": 32, "qkv_bias": True, "offsets": True, "v_int8": True},
                                                 id="v_apart_q4_k_m")])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_qk_norm_heads_in_one_operator_are_the_operators_one_at_a_time(ops, rows, config):
    """llmcore::int4_norm_qkv_norm_rope gives, bit for bit, what the attention norm, the qkv
    GEMM, each head's norm and RoPE give one operator at a time (how such layers ran before
    it): the same kernels in one call."""
    from llmcore_kernels.layers import KernelLayer

    block = int4_block(qk_norm=True, **config)
    with torch.no_grad():
        for norm in (block.attention.q_norm, block.attention.k_norm):
            norm.weight.uniform_(0.5, 1.5)
    layer = KernelLayer(block)
    x = torch.randn(1, rows, block.attention.wq.in_features, generator=torch.Generator().manual_seed(rows))
    cos, sin = rope_tables(rows, block.attention.head_dim)
    got = torch.ops.llmcore.int4_norm_qkv_norm_rope.default(
        x, layer.attention_norm, layer.attention_eps, layer.qkv, layer.qkv_scales, layer.qkv_sums, layer.qkv_bias,
        layer.qkv_offsets, layer.q_norm, layer.k_norm, layer.qk_eps, cos, sin, layer.n_heads, layer.n_kv_heads,
        layer.wv, layer.wv_scales, layer.wv_sums, layer.wv_offsets)
    want = _qkv_normed_head_by_head(layer, x, cos, sin)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape and torch.equal(g, w), name


def test_qk_norms_are_checked_by_the_operator(ops):
    from llmcore_kernels.layers import KernelLayer

    layer = KernelLayer(int4_block(qk_norm=True))
    x = torch.randn(1, 3, layer.qkv_scales.shape[1] * 32)
    cos, sin = rope_tables(3, layer.head_dim)
    with pytest.raises(RuntimeError, match="int4_norm_qkv_norm_rope: the norm's weight"):
        torch.ops.llmcore.int4_norm_qkv_norm_rope.default(
            x, layer.attention_norm, layer.attention_eps, layer.qkv, layer.qkv_scales, layer.qkv_sums, layer.qkv_bias,
            layer.qkv_offsets, layer.q_norm[:-2], layer.k_norm, layer.qk_eps, cos, sin, layer.n_heads,
            layer.n_kv_heads)
    with pytest.raises(RuntimeError, match="qk_eps must be finite"):
        torch.ops.llmcore.int4_norm_qkv_norm_rope.default(
            x, layer.attention_norm, layer.attention_eps, layer.qkv, layer.qkv_scales, layer.qkv_sums, layer.qkv_bias,
            layer.qkv_offsets, layer.q_norm, layer.k_norm, -1.0, cos, sin, layer.n_heads, layer.n_kv_heads)


@pytest.mark.parametrize("view", ["avxvnni", "avx2", "sse4"])
def test_qk_norm_heads_in_every_isa_view(kernel_library, passes_in_isa_view, view):
    passes_in_isa_view(view, __file__, "qk_norm_heads_in_one_operator or q_and_k_norms_computes")


@pytest.mark.parametrize("view", ["avxvnni", "avx2", "sse4"])
def test_v_apart_in_every_isa_view(kernel_library, passes_in_isa_view, view):
    """A v of its own kind: int8 rows in x's order beside int4 q and k in the arranged one,
    each view's GEMMs and roundings."""
    passes_in_isa_view(view, __file__, "v_apart and not isa_view")


@pytest.mark.parametrize("config", [{}, {"head_dim": 32, "qkv_bias": True}, {"offsets": True}, {"int8": True},
                                    pytest.param({"head_dim": 32, "qkv_bias": True, "offsets": True, "v_int8": True},
                                                 id="v_apart_q4_k_m")])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_layer_with_q_and_k_norms_computes_what_the_block_computes(ops, rows, config):
    """Qwen3's per-head q and k norms (head_dim apart from dim / heads with 32): the attention
    norm, the qkv GEMM, each head's norm and RoPE in llmcore::int4_norm_qkv_norm_rope."""
    from llmcore_kernels import mlp
    from llmcore_kernels.layers import KernelLayer

    block = int4_block(qk_norm=True, **config)
    with torch.no_grad():
        for norm in (block.attention.q_norm, block.attention.k_norm):
            norm.weight.uniform_(0.5, 1.5)
    layer = KernelLayer(block)
    assert layer.q_norm is not None
    x = torch.randn(1, rows, block.attention.wq.in_features, generator=torch.Generator().manual_seed(rows))
    cos, sin = rope_tables(rows, block.attention.head_dim)
    with torch.no_grad(), mlp.computing_as_the_kernels(block):
        want, got = block(x, cos, sin), layer(x, cos, sin)
    error = float((got - want).norm() / (want - x).norm())
    assert error < 0.01, error


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: exact_gelu(int4_block()), "its MLP's activation is gelu, not one of silu, gelu_tanh"),
        (lambda: int4_block(o_bias=True), "its wo has a bias"),
        (lambda: halves_rope(int4_block()), "differs from the kernels"),
    ],
)
def test_the_rewrite_refuses_layers_the_kernels_cannot_run(ops, make, reason):
    from llmcore_kernels import layers

    model = torch.nn.ModuleList([int4_block(), make()])
    with pytest.raises(LlmcoreError, match=f"8da4w-layers: 1 layer.*1: .*{reason}") as caught:
        layers.apply(model, "8da4w-layers", "8da4w-mlp or 8da4w")
    assert "--quantize 8da4w-mlp or 8da4w" in caught.value.fix
    with pytest.raises(LlmcoreError, match="gguf-layers: the model has no Llama layers") as caught:
        layers.apply(torch.nn.Sequential(torch.nn.Linear(4, 4)), "gguf-layers", "gguf")
    assert "--quantize gguf" in caught.value.fix


def test_a_layer_keeps_its_attention_module(ops):
    from llmcore_kernels import layers

    block = int4_block()
    attention = block.attention.attn
    model = torch.nn.ModuleList([block])
    assert layers.swap_layers(model) == (1, [])
    assert isinstance(model[0], layers.KernelLayer) and model[0].attn is attention
    assert isinstance(attention, CausalAttention)


@pytest.fixture(scope="module")
def layers_export(kernel_library, tmp_path_factory):
    """The tiny random Llama exported for XNNPACK with --quantize 8da4w-layers and 8da4w, each
    also with asymmetric=true (blocks with offsets, as a GGUF's Q4_1 has)."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    folder = tmp_path_factory.mktemp("layers")
    results = {}
    for recipe in ("8da4w-layers", "8da4w"):
        for asymmetric in (False, True):
            name = recipe + (" asymmetric" if asymmetric else "")
            options = ExportOptions(model="llama", config="tiny", plugins=["xnnpack"], quantize=recipe,
                                    quantize_options={"asymmetric": asymmetric},
                                    output=str(folder / f"{name.replace(' ', '-')}.pte"), quiet=True)
            results[name] = export(options, load_registry())
    return results


def test_the_program_runs_its_layers_without_xnnpack(layers_export):
    from llmcore.runtime import libraries

    result = layers_export["8da4w-layers"]
    ops = libraries.program_operators(result.pte.read_bytes())
    for op in ("int4_norm_qkv_rope", "int4_linear_add", "int4_norm_mlp_add", "int4_linear", "rms_norm"):
        assert f"llmcore::{op}.out" in ops
    # the final norm and the output layer on the kernels too, and no partition of reshapes alone
    delegation = result.report["delegation"]
    assert delegation["delegated_subgraphs"] == 0
    assert all(o["delegated"] == 0 for o in delegation["operators"])
    parity = result.report["parity"]
    assert parity["top1_agreement"] == 1.0 and parity["max_abs_diff"] < 0.05


@pytest.mark.parametrize("variant", ["", " asymmetric"])
def test_the_program_computes_what_8da4w_computes(layers_export, variant):
    """Both programs hold 8da4w's integers (with per-block offsets when asymmetric): their
    logits on one prompt agree."""
    from llmcore import runtime
    from llmcore.runtime import libraries
    from llmcore.runtime import Program
    from llmcore_kernels import library

    ours = layers_export["8da4w-layers" + variant]
    assert "llmcore::int4_norm_mlp_add.out" in libraries.program_operators(ours.pte.read_bytes())
    assert ours.report["parity"]["top1_agreement"] == 1.0 and ours.report["parity"]["max_abs_diff"] < 0.05
    ids = [1, 40, 50, 60, 70, 80, 90]
    want = torch.as_tensor(Program.load(layers_export["8da4w" + variant].pte).logits(ids, input_pos=0))
    assert not library.own_threads()  # delegates: the kernels on ExecuTorch's pool
    got = torch.as_tensor(Program.load(ours.pte).logits(ids, input_pos=0))
    assert library.own_threads()  # no delegate: on their own
    assert float((got - want).norm() / want.norm()) < 0.02
    assert int(got.argmax()) == int(want.argmax())
    # The kernels' threads split each projection's columns, mid-head with three (then RoPE
    # and the residual adds run on each thread's own columns): one thread and three give
    # the very same logits.
    threads = runtime.runtime_threads()
    try:
        by_count = {}
        for count in (1, 3):
            runtime.use_threads(count)
            by_count[count] = torch.as_tensor(Program.load(ours.pte).logits(ids, input_pos=0)).clone()
    finally:
        runtime.use_threads(threads)
    assert torch.equal(by_count[1], by_count[3])


@pytest.fixture(scope="module")
def int8_layers_export(kernel_library, tmp_path_factory):
    """The tiny random Llama exported with --quantize 8da8w-layers, and with 8da8w without the
    outlier split (the same integers, on XNNPACK)."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    folder = tmp_path_factory.mktemp("int8-layers")
    return {recipe: export(ExportOptions(model="llama", config="tiny", plugins=["xnnpack"], quantize=recipe,
                                         quantize_options={"outlier_split": False},
                                         output=str(folder / f"{recipe}.pte"), quiet=True), load_registry())
            for recipe in ("8da8w-layers", "8da8w")}


def test_the_int8_program_computes_what_8da8w_computes(int8_layers_export):
    from llmcore.runtime import libraries
    from llmcore.runtime import Program

    ours = int8_layers_export["8da8w-layers"]
    ops = libraries.program_operators(ours.pte.read_bytes())
    assert {f"llmcore::{op}.out" for op in ("int4_norm_qkv_rope", "int4_linear_add", "int4_norm_mlp_add",
                                             "int4_linear")} <= set(ops)
    assert ours.report["delegation"]["delegated_subgraphs"] == 0
    assert ours.report["parity"]["top1_agreement"] == 1.0 and ours.report["parity"]["max_abs_diff"] < 0.05
    ids = [1, 40, 50, 60, 70, 80, 90]
    want = torch.as_tensor(Program.load(int8_layers_export["8da8w"].pte).logits(ids, input_pos=0))
    got = torch.as_tensor(Program.load(ours.pte).logits(ids, input_pos=0))
    assert float((got - want).norm() / want.norm()) < 0.01
    assert int(got.argmax()) == int(want.argmax())


def test_8da8w_layers_refuses_the_outlier_split(kernel_library, tmp_path):
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    options = ExportOptions(model="llama", config="tiny", plugins=["xnnpack"], quantize="8da8w-layers",
                            quantize_options={"outlier_split": True}, output=str(tmp_path / "m.pte"), quiet=True)
    with pytest.raises(LlmcoreError, match="8da8w-layers: outlier_split=True gives linears") as caught:
        export(options, load_registry())
    assert "--quantize 8da8w" in caught.value.fix
    assert not (tmp_path / "m.pte").exists()


@pytest.mark.parametrize("recipe", ["8da4w-layers", "8da8w-layers"])
def test_llmcore_run_and_llmcore_runner_agree(layers_export, int8_layers_export, runner, llmcore_cli, recipe):
    pte = {**layers_export, **int8_layers_export}[recipe].pte
    result = llmcore_cli("run", str(pte), "--prompt", PROMPT, "--max-new-tokens", "16", "--json")
    assert result.returncode == 0, result.stderr
    python_ids = json.loads(result.stdout)["generated_ids"]
    out = subprocess.run(
        [str(runner), str(pte), "--prompt", PROMPT, "--max-new-tokens", "16", "--temperature", "0", "--print-ids"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("ids:"))
    assert [int(i) for i in line.split()[1:]] == python_ids


def test_the_runner_puts_the_kernels_on_their_own_threads_without_delegates(layers_export, runner):
    """llmcore_runner chooses the kernels' threads as Program.load does: their own in a
    program with no delegate, ExecuTorch's pool in one with delegates."""
    for name, where in (("8da4w-layers", "their own threads"), ("8da4w", "ExecuTorch's thread pool")):
        out = subprocess.run([str(runner), str(layers_export[name].pte), "--prompt", PROMPT, "--max-new-tokens", "1",
                              "--verbose"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert f"llmcore's kernels on {where}" in out.stderr, name


@pytest.mark.parametrize(
    "family, config",
    [
        ("mistral", "mistral-tiny"),  # a sliding window on every layer (the attention module's)
        ("phi", "phi3-tiny"),  # partial rotary: cos 1 and sin 0 past the rotated channels
        ("qwen", "qwen2-tiny"),  # q, k and v biases
        ("qwen", "qwen3-tiny"),  # q and k norms over each head (int4_norm_qkv_norm_rope)
        ("gemma", "gemma2-tiny"),  # sandwich norms, GeGLU, soft-capped attention in the attention module
        ("gemma", "gemma3-tiny"),  # and q and k norms, local and global RoPE bases
    ],
)
def test_the_families_built_on_llama_layers(kernel_library, tmp_path, family, config):
    from llmcore.runtime import libraries
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    options = ExportOptions(model=family, config=config, plugins=["xnnpack"], quantize="8da4w-layers",
                            output=str(tmp_path / "model.pte"), quiet=True)
    result = export(options, load_registry())
    ops = libraries.program_operators(result.pte.read_bytes())
    gemma = family == "gemma"  # the post-norm and GeGLU operators in place of Llama's last two
    assert ({"llmcore::int4_linear_norm_add.out", "llmcore::int4_norm_glu_add.out"} if gemma else
            {"llmcore::int4_linear_add.out", "llmcore::int4_norm_mlp_add.out"}) <= set(ops)
    assert not gemma or "llmcore::int4_norm_mlp_add.out" not in ops
    # q and k norms: the heads normed before RoPE in the layer's first operator, no RoPE
    # left to the graph (nor to XNNPACK, listed after the kernels)
    head_norms = config in ("qwen3-tiny", "gemma3-tiny")
    assert ("llmcore::int4_norm_qkv_rope.out" in ops) != head_norms
    assert ("llmcore::int4_norm_qkv_norm_rope.out" in ops) == head_norms
    assert not head_norms or "llmcore::rms_norm.out" in ops  # the final norm
    # and Gemma 2's soft-capped attention, which its attention module computes in the graph
    delegated = result.report["delegation"]["by_backend"].get("XnnpackBackend", {}).get("operators", {})
    soft_capped = {"aten_bmm_default", "aten__softmax_default", "aten_tanh_default", "aten_div_Tensor",
                   "aten_permute_copy_default", "dim_order_ops__clone_dim_order_default"}
    allowed = {"aten_add_Tensor", "aten_sub_Tensor", "aten_mul_Tensor", "aten_cat_default",
               "aten_unsqueeze_copy_default", "aten_view_copy_default"}
    assert set(delegated) <= allowed | (soft_capped if config == "gemma2-tiny" else set()), delegated
    assert result.report["parity"]["top1_agreement"] == 1.0 and result.report["parity"]["max_abs_diff"] < 0.05


@pytest.mark.parametrize("view", ["avxvnni", "avx2", "sse4"])
def test_a_gemma_layer_computes_its_block_in_every_isa_view(kernel_library, passes_in_isa_view, view):
    """The GeGLU activation and the post-norms have an AVX2 path and a portable one (int4_mlp.cpp's
    glu_times): the Gemma layer tests again, in a process whose kernels see only the view's
    instruction sets (llmcore/testing/isa_view.py), so that an AVX-512 machine checks both."""
    passes_in_isa_view(view, __file__, "gemma_layer_on_the_kernels")
