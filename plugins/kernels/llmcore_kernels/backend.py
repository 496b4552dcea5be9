"""The ``kernels`` backend: llmcore's layer operators take what they run, before export.

``--plugins kernels,xnnpack`` (the default list of a quantized CPU export where both are
installed): after the recipe has quantized the model (``gguf``, ``8da4w``, ``8da8w``, the
integers it chose), each layer the operators compute exactly is swapped for
:class:`~llmcore_kernels.layers.KernelLayer` (a Llama layer) or
:class:`~llmcore_kernels.layernorm_layers.KernelLayerNormBlock` (GPT-2's), then the final
norm and the output layer; each
layer they cannot take stays as it is, for XNNPACK to delegate, and the export's summary says
why (a float layer, an outlier split, a form the operators lack). So which integers (the
recipe) and which kernels run them (the backends, in order) are chosen apart: ``--plugins
xnnpack`` leaves every layer to XNNPACK, a vendor's partitioner listed first still sees the
graph first, and the ``*-layers`` recipes stay as the strict form that refuses a model whose
every layer the kernels cannot take.
"""

from __future__ import annotations

from torch import nn

from llmcore.records import ModulesTaken
from llmcore_kernels import layers, mlp
from llmcore_xnnpack.qlinear import BlockInt4Linear


def take(module: nn.Module, options: dict) -> ModulesTaken:
    """Swap every layer (and the final norm and output layer) the kernels run; return what
    was taken and, by name, what was left and why."""
    if not any(isinstance(m, mlp.QUANTIZED_LINEARS) for m in module.modules()):
        return ModulesTaken(taken=(), note="the model has no int4 or int8 linears (the kernels run quantized "
                            "layers: export a quantized GGUF, or --quantize 8da4w or 8da8w)")
    from llmcore_kernels.layernorm_layers import KernelLayerNormBlock
    from llmcore_kernels.rmsnorm import FusedRMSNorm

    _, left = layers.swap_layers(module)
    left_linears = layers.swap_outside_layers(module)
    for linear in module.modules():  # what is left goes to XNNPACK, which lowers int8 integers
        if isinstance(linear, BlockInt4Linear):
            linear.unpack_()
    taken = tuple(name for name, m in module.named_modules()
                  if isinstance(m, (layers.KernelLayer, KernelLayerNormBlock, layers.KernelLinear, FusedRMSNorm,
                                    layers.KernelQ6KEmbedding)))
    return ModulesTaken(taken=taken, left=tuple(left) + tuple(left_linears))
