"""MPS exports of the tiny models: static shapes inside the delegates, the rest on the CPU.

The pip wheel's runtime has no MPS backend; the MPS graphs are decoded with the
flatbuffer schema ExecuTorch ships for MPS instead.
"""

from __future__ import annotations

import pytest

from llmcore.testing.conformance import export_tiny, transformer_linear_layers

# ExecuTorch 1.5 removed MPS: there llmcore-mps refuses to import (and the main env does
# not install it), so this module skips; `make test-mps` runs it on executorch 1.4.1.
pytest.importorskip("llmcore_mps", exc_type=ImportError)

from llmcore_mps.payload import mps_graphs, mps_operators  # noqa: E402

MPS = "MPSBackend"


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_blocks_run_in_mps_with_static_shapes(family):
    result = export_tiny("mps", family, fallbacks=("xnnpack",))
    report = result.report
    assert report["transforms"] == ["mps-static-length"]
    assert report["metadata_methods"]["use_kv_cache"] is False
    assert report["metadata_methods"]["enable_dynamic_shape"] is True  # the program still takes 1..128 tokens
    mps = report["delegation"]["by_backend"][MPS]["operators"]
    assert "sym_size_int" not in mps and "sym_size" not in mps
    # Padding the tokens and picking the last real position stay outside MPS.
    outside = {r["op_type"] for r in report["delegation"]["operators"] if r["not_delegated"]}
    assert {"aten_constant_pad_nd_default", "aten_slice_copy_tensor"} <= outside
    graphs = mps_graphs(result.pte)
    dims = [v["dims"] for g in graphs for v in g["mps_values"]]
    assert dims and all(isinstance(d, int) and d >= 0 for shape in dims for d in shape)
    assert [1, 128] in dims  # the padded tokens
    ops = mps_operators(result.pte)
    assert ops["MPSSoftmax"] == 2
    matmuls = sum(n for op, n in ops.items() if op in ("MPSAddmm", "MPSMatMul", "MPSBmm", "MPSLinear"))
    assert matmuls >= transformer_linear_layers(family)


def test_fp16_option_reaches_the_graph():
    fp32 = mps_graphs(export_tiny("mps", "nanogpt").pte)
    fp16 = mps_graphs(export_tiny("mps", "nanogpt", backend_options={"fp16": True}).pte)
    kinds = lambda graphs: {v["datatype"] for g in graphs for v in g["mps_values"]}  # noqa: E731
    assert "mps_data_type_float16" in kinds(fp16) and "mps_data_type_float16" not in kinds(fp32)
