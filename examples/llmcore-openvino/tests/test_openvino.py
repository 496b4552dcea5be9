"""llmcore-openvino: conformance, transform equivalence and running the programs here.

Parity: the tiny programs run by the wheel's OpenvinoBackend (OpenVINO CPU plugin) match
eager PyTorch within 1e-2 with the same argmax (observed 3.1e-3 for nanoGPT: OpenVINO's
CPU plugin may compute in reduced precision (bf16 / fp16 inference hint) where the CPU has
it). The openvino-attention rewrite itself is exact to 1e-5 in eager PyTorch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmcore.modules import CausalAttention
from llmcore.testing.conformance import BackendConformance, diff_from_tiny, export_tiny, transformed_tiny
from llmcore.testing.equivalence import attention_diff
from llmcore_openvino.attention import AdditiveMaskAttention

PARITY_TOL = 1e-2


class TestOpenvinoConformance(BackendConformance):
    backend = "openvino"
    runs_here = True  # the wheel registers OpenvinoBackend; it loads the openvino package
    parity_tolerance = PARITY_TOL
    bad_options = [{"device": "TPU"}]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("seq_len", [1, 9, 32])
def test_additive_mask_attention_matches_causal_attention(heads, seq_len):
    n_heads, n_kv = heads
    assert attention_diff(AdditiveMaskAttention(n_heads, n_kv, 16, 32), n_heads, n_kv, 16, seq_len) <= 1e-6


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_transformed_model_matches_original(family):
    module, context, applied = transformed_tiny(family, ["openvino"])
    assert applied == ["openvino-attention"] and not context.use_kv_cache  # kv-cache replaced
    assert not any(type(m) is CausalAttention for m in module.modules())
    assert diff_from_tiny(module, family) <= 1e-5


def test_kv_cache_static_is_refused_clearly():
    from llmcore.errors import LlmcoreError

    with pytest.raises(LlmcoreError, match="KV cache"):
        transformed_tiny("nanogpt", ["openvino"], transforms=["kv-cache-static"])


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_llmcore_run_generates_with_the_program(family):
    result = export_tiny("openvino", family)
    report = result.report
    assert report["parity"]["max_abs_diff"] <= PARITY_TOL and report["parity"]["top1_agreement"] == 1.0
    assert set(report["delegation"]["by_backend"]) == {"OpenvinoBackend"}
    proc = subprocess.run(
        [sys.executable, "-m", "llmcore", "run", str(result.pte), "--prompt", "hello", "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() or proc.stderr.strip()
