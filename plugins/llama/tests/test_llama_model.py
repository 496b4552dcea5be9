"""Eager correctness of the Llama module against a naive reference, and torch.export."""

import math
from dataclasses import replace

import pytest
import torch

from llama_testutils import TINY, meta_state_dict, random_model, reference_forward, tokens
from llmcore.modules import CausalAttention
from llmcore_llama.config import CONFIGS, LlamaConfig, RopeScaling
from llmcore_llama.model import rope_inv_freq

ATOL = 1e-5  # float32, logits of magnitude ~1-10


@pytest.mark.parametrize(
    "n_heads,n_kv_heads",
    [(4, 4), (4, 2), (4, 1)],
    ids=["mha", "gqa", "mqa"],
)
def test_logits_match_naive_reference(n_heads, n_kv_heads):
    cfg = replace(TINY, n_heads=n_heads, n_kv_heads=n_kv_heads)
    model = random_model(cfg)
    sd = meta_state_dict(model)
    toks = tokens(9, cfg.vocab_size)
    ref = reference_forward(sd, cfg, toks)
    with torch.no_grad():
        for t in range(1, toks.shape[1] + 1):  # every prefix: checks causality too
            got = model(toks[:, :t])
            assert got.shape == (1, cfg.vocab_size)
            torch.testing.assert_close(got[0], ref[t - 1], atol=ATOL, rtol=0)


def test_tied_embeddings_share_storage():
    model = random_model(replace(TINY, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    sd = meta_state_dict(model)
    ref = reference_forward(sd, model.config, tokens(5, 320))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens(5, 320))[0], ref[-1], atol=ATOL, rtol=0)


def test_attention_goes_through_causal_attention_seam():
    model = random_model()
    seams = [m for m in model.modules() if isinstance(m, CausalAttention)]
    assert len(seams) == TINY.n_layers
    assert all(isinstance(layer.attention.attn, CausalAttention) for layer in model.layers)
    assert not any("cache" in name for name, _ in model.named_buffers())


def test_input_pos_shifts_rope_positions():
    """With input_pos, RoPE uses rows [pos, pos+T). Without a cache attention only sees
    these T tokens, and RoPE depends only on relative positions, so logits are unchanged;
    the positions themselves are checked against the reference."""
    model = random_model()
    sd = meta_state_dict(model)
    toks = tokens(6, TINY.vocab_size)
    pos = 5
    ref = reference_forward(sd, TINY, toks, positions=torch.arange(pos, pos + 6))
    with torch.no_grad():
        got = model(toks, torch.tensor([pos]))
        plain = model(toks)
    torch.testing.assert_close(got[0], ref[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got, plain, atol=1e-4, rtol=0)
    # The q/k that reach the seam really are rotated by absolute positions.
    seen = {}
    attn = model.layers[0].attention.attn
    handle = attn.register_forward_hook(lambda m, args, out: seen.update(q=args[0]))
    with torch.no_grad():
        model(toks, torch.tensor([pos]))
    handle.remove()
    q0 = model.layers[0].attention.wq(model.layers[0].attention_norm(model.tok_embeddings(toks)))
    q0 = q0.view(1, 6, TINY.n_heads, TINY.resolved_head_dim)[0, 0, 0]
    angle = pos * rope_inv_freq(TINY)[0]
    expect = torch.stack([q0[0] * math.cos(angle) - q0[1] * math.sin(angle), q0[0] * math.sin(angle) + q0[1] * math.cos(angle)])
    torch.testing.assert_close(seen["q"][0, 0, 0, :2], expect, atol=1e-5, rtol=0)


def test_llama31_rope_scaling_matches_formula():
    cfg = replace(TINY, rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64))
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, 16, 2).float() / 16))
    expected = []
    for f in base.tolist():  # the published piecewise rule, one frequency at a time
        wavelen = 2 * math.pi / f
        if wavelen < 64 / 4.0:
            expected.append(f)
        elif wavelen > 64 / 1.0:
            expected.append(f / 8.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * f / 8.0 + smooth * f)
    got = rope_inv_freq(cfg)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-6, atol=0)
    assert (got != base).any() and (got == base).any()  # some scaled, some kept
    model = random_model(cfg)
    toks = tokens(7, cfg.vocab_size)
    ref = reference_forward(meta_state_dict(model), cfg, toks, inv_freq=torch.tensor(expected))
    with torch.no_grad():
        torch.testing.assert_close(model(toks)[0], ref[-1], atol=ATOL, rtol=0)


def test_explicit_rope_freq_factors():
    factors = tuple(1.0 + i for i in range(TINY.resolved_head_dim // 2))
    cfg = replace(TINY, rope_freq_factors=factors)
    base = rope_inv_freq(TINY)
    torch.testing.assert_close(rope_inv_freq(cfg), base / torch.tensor(factors))


def test_configs_are_valid():
    tiny, smol = CONFIGS["tiny"], CONFIGS["smollm2-135m"]
    assert (tiny.dim, tiny.n_layers, tiny.n_heads, tiny.n_kv_heads, tiny.vocab_size, tiny.tie_embeddings) == (64, 2, 4, 2, 320, True)
    assert (smol.dim, smol.n_layers, smol.n_heads, smol.n_kv_heads, smol.hidden_dim, smol.vocab_size) == (576, 30, 9, 3, 1536, 49152)
    assert smol.rope_theta == 100000.0 and smol.tie_embeddings and smol.resolved_head_dim == 64
    with pytest.raises(ValueError):
        LlamaConfig(dim=64, n_layers=1, n_heads=3, n_kv_heads=2, vocab_size=10, hidden_dim=8)


def test_torch_export_dynamic_seq_len():
    from llmcore_llama import build_random
    from llmcore.records import LoadOptions

    lm = build_random("tiny", LoadOptions())
    model = lm.module
    seq = torch.export.Dim("seq", min=1, max=lm.metadata.max_seq_len)
    example = tokens(8, lm.metadata.vocab_size)
    ep = torch.export.export(model, (example,), dynamic_shapes={"tokens": {1: seq}}, strict=False)
    for n in (1, 3, 17, lm.metadata.max_seq_len):
        t = tokens(n, lm.metadata.vocab_size, seed=n)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(t), model(t), atol=1e-6, rtol=0)
    # no complex numbers anywhere in the graph
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert not val.is_complex(), node


def test_torch_export_with_input_pos():
    from llmcore_llama import build_random
    from llmcore.records import LoadOptions

    model = build_random("tiny", LoadOptions()).module
    seq = torch.export.Dim("seq", min=1, max=64)
    ep = torch.export.export(
        model, (tokens(4, 320), torch.tensor([0])), dynamic_shapes={"tokens": {1: seq}, "input_pos": None}, strict=False
    )
    t = tokens(5, 320)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(t, torch.tensor([7])), model(t, torch.tensor([7])), atol=1e-6, rtol=0)


def test_bfloat16_build():
    from llmcore_llama import build_random
    from llmcore.records import LoadOptions

    lm = build_random("tiny", LoadOptions(dtype="bfloat16"))
    assert lm.module.tok_embeddings.weight.dtype == torch.bfloat16
    assert lm.module.freqs_cos.dtype == torch.float32
    with torch.no_grad():
        out = lm.module(tokens(4, 320))
    assert out.shape == (1, 320) and torch.isfinite(out.float()).all()
