"""Numerical equivalence of a transformed module with the original, in eager PyTorch.

Source transforms must not change what a model computes. :func:`max_logit_diff` runs a
transformed model and its original on the same random tokens and returns the largest
absolute difference of their logits:

* without a KV cache, at several sequence lengths (the whole window each time);
* with one (``forward(tokens, input_pos)``), a prefill followed by single-token decode
  steps, each compared with the original recomputing the whole prefix.

:func:`attention_diff` does the same for one attention module against
:class:`llmcore.modules.CausalAttention`.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _call(module, tokens, pos=None):
    from llmcore.runtime import captured_stderr

    with torch.no_grad(), captured_stderr():  # the llama:: ops log on every eager call
        if pos is None:
            return module(tokens)
        return module(tokens, torch.tensor([pos], dtype=torch.long))


def max_logit_diff(
    candidate,
    reference,
    *,
    vocab_size: int,
    use_kv_cache: bool = False,
    lengths: Sequence[int] = (1, 17, 128),
    prefill: int = 16,
    decode_steps: int = 8,
    seed: int = 1,
) -> float:
    """Largest ``|candidate - reference|`` over the logits of the runs described above."""
    longest = max([*lengths, prefill + decode_steps])
    tokens = torch.randint(0, vocab_size, (1, longest), generator=torch.Generator().manual_seed(seed))
    worst = 0.0
    if not use_kv_cache:
        for n in lengths:
            diff = (_call(candidate, tokens[:, :n]) - _call(reference, tokens[:, :n])).abs().max()
            worst = max(worst, float(diff))
        return worst
    first = _call(candidate, tokens[:, :prefill], 0)
    worst = float((first - _call(reference, tokens[:, :prefill])).abs().max())
    for pos in range(prefill, prefill + decode_steps):
        got = _call(candidate, tokens[:, pos : pos + 1], pos)
        worst = max(worst, float((got - _call(reference, tokens[:, : pos + 1])).abs().max()))
    return worst


def attention_diff(candidate, n_heads: int, n_kv_heads: int, head_dim: int, seq_len: int, seed: int = 0) -> float:
    """Largest difference between ``candidate(q, k, v)`` and ``CausalAttention`` on random
    ``[1, seq_len, H, D]`` inputs."""
    from llmcore.modules import CausalAttention

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq_len, n_heads, head_dim, generator=gen)
    k = torch.randn(1, seq_len, n_kv_heads, head_dim, generator=gen)
    v = torch.randn(1, seq_len, n_kv_heads, head_dim, generator=gen)
    with torch.no_grad():
        want = CausalAttention(n_heads, n_kv_heads, head_dim)(q, k, v)
        got = candidate(q, k, v)
    assert got.shape == want.shape, f"{tuple(got.shape)} != {tuple(want.shape)}"
    return float((got - want).abs().max())
