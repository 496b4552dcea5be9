"""The XNNPACK plugin's post-pass names the operators ExecuTorch's pass rewrites, so that
skipping it where none is called leaves the program as the pass would (the programs of
``test_lowering.py``, compared byte for byte with every post-pass run, check the rest)."""

from __future__ import annotations

import pytest

import llmcore_xnnpack


def test_convert_to_linear_names_the_operators_of_the_pass():
    module = pytest.importorskip("executorch.backends.xnnpack._passes.convert_to_linear")
    targets = {target.name() for target in module.ConvertToLinearPass.targets}
    assert set(llmcore_xnnpack.CONVERT_TO_LINEAR_REWRITES) == targets
    (post,) = [p for p in llmcore_xnnpack.llmcore_post_passes() if p.name == "convert-to-linear"]
    assert post.rewrites == llmcore_xnnpack.CONVERT_TO_LINEAR_REWRITES
