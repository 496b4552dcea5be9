"""llmcore-kernels: custom ExecuTorch kernels for llmcore models.

Provides

* the runtime library ``llmcore_kernels``: the kernels, written against the ExecuTorch
  runtime headers of the executorch wheel and built by the project's CMake
  (``make runner``) into ``build/libllmcore_kernels.so`` (ExecuTorch registration) and
  ``build/libllmcore_kernels_aot.so`` (PyTorch registration);
* the specialized runtime library ``llmcore_llm_ops``: the C++ runner's attention kernel
  (``llama::custom_sdpa`` on float32), which Python processes then run instead of
  ExecuTorch's own (``build/libllmcore_llm_ops.so``; see ``csrc/llm_ops.cpp``);
* the source transform ``fused-rmsnorm`` (``--transforms fused-rmsnorm``): Llama-style
  RMSNorm modules become one call of ``llmcore::rms_norm``.

See ``docs/custom-kernels.md`` for how this plugin is put together.
"""

from __future__ import annotations

from llmcore import hookimpl
from llmcore.records import RuntimeLibrary, SourceTransform

from llmcore_kernels import library

__version__ = "0.1.0"

# Runtime operator names the native library registers (kept here, not in .ops, so that
# listing plugins does not load the library).
OPS = ("llmcore::rms_norm.out",)
# ExecuTorch's ops whose float32 calls libllmcore_llm_ops.so takes over (kernel keys)
LLM_OPS = ("llama::custom_sdpa.out",)


def _apply_fused_rmsnorm(module, context):
    from llmcore_kernels import rmsnorm

    return rmsnorm.apply(module, context)


@hookimpl
def llmcore_runtime_libraries() -> list[RuntimeLibrary]:
    return [
        RuntimeLibrary(
            name="llmcore_kernels",
            description="fused RMSNorm (llmcore::rms_norm.out), C++ against the ExecuTorch runtime headers",
            ops=OPS,
            python_module="llmcore_kernels.ops",
            shared_library=library.runtime_library,
        ),
        RuntimeLibrary(
            name="llmcore_llm_ops",
            description="llmcore_runner's attention kernel for float32 llama::custom_sdpa, in Python "
            "processes too: without it they run ExecuTorch's, whose decode steps spend a third of "
            "their time in MKL's matrix-vector products at long contexts (docs/performance.md)",
            ops=LLM_OPS,
            shared_library=library.llm_ops_library,
            declared=False,
            specialized=True,
        ),
        RuntimeLibrary(
            name="llmcore_xnnpack_reshape",
            description="XNNPACK's whole-runtime reshape only when a delegate's input shapes changed, as in "
            "llmcore_runner: ExecuTorch's delegate asks for one on every call, ~9% of a decode step's "
            "time on SmolLM2 (docs/performance.md); LLMCORE_XNNPACK_RESHAPE=always turns it off",
            ops=(),
            shared_library=library.xnnpack_reshape_library,
            declared=False,
            preload=True,
        ),
    ]


@hookimpl
def llmcore_source_transforms() -> list[SourceTransform]:
    return [
        SourceTransform(
            name="fused-rmsnorm",
            description="swap Llama-style RMSNorm modules for the fused llmcore::rms_norm kernel "
            "(programs then need the llmcore_kernels runtime library)",
            apply=_apply_fused_rmsnorm,
            order=60,
        )
    ]
