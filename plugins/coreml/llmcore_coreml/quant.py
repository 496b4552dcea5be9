"""Quantizer recipes Core ML lowers (all weight-only: Core ML stores int8/int4 weights and
dequantizes them on the fly; activations stay in the compute precision).

* ``coreml-8w`` and ``coreml-4w`` (source level): torchao ``IntxWeightOnlyConfig``, int8
  per output channel or int4 per group. The exported graph carries
  ``torchao::dequantize_affine``, which ExecuTorch's Core ML frontend converts to Core
  ML's ``constexpr_blockwise_shift_scale`` weights (iOS 18 / macOS 15).
* ``coreml-pt2e-8w`` (pt2e): Core ML's own ``CoreMLQuantizer`` with coremltools' linear
  quantizer config, int8 symmetric per-channel weights and fp32 activations. It lowers to
  the same Core ML weights. Its annotation traces some 400 pattern graphs with
  ``torch.export`` whatever the model: a long quantize stage even for a tiny one
  (docs/backends.md).
"""

from __future__ import annotations

import torch

from llmcore.errors import LlmcoreError

GROUP_SIZES = (16, 32, 64, 128)


def weight_only_int8_quantizer(options: dict):
    import coremltools as ct
    from executorch.backends.apple.coreml.quantizer import CoreMLQuantizer

    config = ct.optimize.torch.quantization.LinearQuantizerConfig(
        global_config=ct.optimize.torch.quantization.ModuleLinearQuantizerConfig(
            quantization_scheme="symmetric",
            activation_dtype=torch.float32,
            weight_dtype=torch.qint8,
            weight_per_channel=True,
        )
    )
    return CoreMLQuantizer(config)


def quantize_weights(module: torch.nn.Module, bits: int, group_size: int = 0) -> torch.nn.Module:
    """torchao weight-only quantization of every linear layer: ``bits`` 8 or 4, one scale
    per output channel (``group_size`` 0) or per group of ``group_size`` in-features."""
    from torchao.quantization import quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import IntxWeightOnlyConfig

    if group_size and group_size not in GROUP_SIZES:
        raise LlmcoreError(
            f"quantizer option group_size={group_size} is not one of {', '.join(map(str, GROUP_SIZES))}.",
            stage="quantize",
            plugin="coreml",
            fix="pass --quantize-option group_size=32 (or 16, 64, 128).",
        )
    granularity = PerGroup(group_size) if group_size else PerAxis(0)

    def linear_it_divides(mod: torch.nn.Module, _fqn: str) -> bool:
        return isinstance(mod, torch.nn.Linear) and (not group_size or mod.in_features % group_size == 0)

    dtype = {8: torch.int8, 4: torch.int4}[bits]
    quantize_(module, IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity), filter_fn=linear_it_divides)
    return module
