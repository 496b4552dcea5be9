"""OpenVINO for llmcore: a vendor's backend plugin, written against the public hook API only.

Provides the ``openvino`` backend: ExecuTorch's ``OpenvinoPartitioner`` with the target
device in its compile specs (``--backend-option openvino.device=CPU``, the default; GPU and
NPU where the OpenVINO runtime finds them). Its delegates are compiled OpenVINO models,
run by the ``OpenvinoBackend`` that the executorch pip wheel registers on x86-64 Linux
once the ``openvino`` package is installed, so ``llmcore export``'s parity check and
``llmcore run`` run them here.

ExecuTorch's OpenVINO modules (and ``openvino`` itself) are imported only inside the
factory: ``llmcore plugins`` stays fast and a missing runtime breaks only exports that
select ``openvino``.
"""

from __future__ import annotations

from llmcore import hookimpl
from llmcore.errors import LlmcoreError
from llmcore.records import Backend, EdgeSettings, Lazy, SourceTransform

__version__ = "0.1.0"

BACKEND = "openvino"
RUNTIME_ID = "OpenvinoBackend"
RUNS_ON = "Intel CPUs, GPUs and NPUs (x86-64 Linux and Windows) with the OpenVINO runtime (pip install 'openvino<2026')"
DEVICES = ("CPU", "GPU", "NPU", "AUTO")


def _partitioners(options: dict) -> list:
    device = options["device"].upper()
    if device.split(".")[0].split(":")[0] not in DEVICES:
        raise LlmcoreError(
            f"unknown OpenVINO device {options['device']!r}.",
            stage="options",
            plugin=BACKEND,
            fix=f"pass --backend-option openvino.device= one of {', '.join(DEVICES)} (GPU.1 names a second GPU).",
        )
    try:
        import openvino  # noqa: F401
    except ImportError as exc:
        raise LlmcoreError(
            "the OpenVINO runtime is not installed.",
            stage="lower",
            plugin=BACKEND,
            fix="pip install 'openvino>=2025.1,<2026' (or reinstall llmcore-openvino with its dependencies).",
        ) from exc
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    from llmcore_openvino.partition import DynamicShapeOpenvinoPartitioner

    return [DynamicShapeOpenvinoPartitioner([CompileSpec("device", device.encode())])]


@hookimpl
def llmcore_partitioners() -> list[Backend]:
    return [
        Backend(
            name=BACKEND,
            description="OpenVINO: Intel's runtime for CPUs, GPUs and NPUs (fp32 graphs compiled by OpenVINO)",
            partitioners=_partitioners,
            edge=EdgeSettings(check_ir_validity=False),
            runtime_id=RUNTIME_ID,
            runs_on=RUNS_ON,
            options={"device": (str, "CPU", f"OpenVINO device the program is compiled for: {', '.join(DEVICES)}")},
        )
    ]


@hookimpl
def llmcore_source_transforms() -> list[SourceTransform]:
    return [
        SourceTransform(
            name="openvino-attention",
            description="programs without a KV cache (replaces kv-cache, whose input_pos.item() reaches "
            "OpenVINO delegates as a SymInt), attention from matmul + finite additive mask + softmax",
            apply=Lazy("llmcore_openvino.attention", "apply"),
            order=60,
            backends=(BACKEND,),
            automatic=True,
            replaces=("kv-cache",),
        )
    ]
