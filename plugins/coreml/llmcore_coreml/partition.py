"""ExecuTorch's Core ML partitioner, configured from llmcore's backend options.

coremltools and ExecuTorch's Core ML modules are imported here, only when an export
selects ``coreml``.
"""

from __future__ import annotations

import logging
import os

from llmcore.errors import LlmcoreError

COMPUTE_UNITS = ("all", "cpu_only", "cpu_and_gpu", "cpu_and_ne")
PRECISIONS = ("fp16", "fp32")


def _choice(name: str, value: str, allowed) -> str:
    if value not in allowed:
        raise LlmcoreError(
            f"backend 'coreml' option {name}={value!r} is not one of {', '.join(allowed)}.",
            stage="options",
            plugin="coreml",
            fix=f"pass --backend-option coreml.{name}=<one of {', '.join(allowed)}>.",
        )
    return value


def deployment_target(name: str):
    """``ct.target.<name>`` (``iOS18``, ``macOS15``, ...), or an error listing them."""
    import coremltools as ct

    targets = [t for t in dir(ct.target) if not t.startswith("_")]
    if name not in targets:
        raise LlmcoreError(
            f"backend 'coreml' option minimum_deployment_target={name!r} is not a coremltools target.",
            stage="options",
            plugin="coreml",
            fix=f"pass one of: {', '.join(targets)}.",
        )
    return getattr(ct.target, name)


def compile_specs(options: dict) -> list:
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    units = _choice("compute_units", options["compute_units"], COMPUTE_UNITS)
    precision = _choice("precision", options["precision"], PRECISIONS)
    return CoreMLBackend.generate_compile_specs(
        compute_unit={
            "all": ct.ComputeUnit.ALL,
            "cpu_only": ct.ComputeUnit.CPU_ONLY,
            "cpu_and_gpu": ct.ComputeUnit.CPU_AND_GPU,
            "cpu_and_ne": ct.ComputeUnit.CPU_AND_NE,
        }[units],
        minimum_deployment_target=deployment_target(options["minimum_deployment_target"]),
        compute_precision=ct.precision.FLOAT16 if precision == "fp16" else ct.precision.FLOAT32,
        model_type=CoreMLBackend.MODEL_TYPE.MODEL,
    )


# Loggers of ExecuTorch's Core ML modules, each set to INFO at import.
_LOGGERS = (
    "executorch.backends.apple.coreml.partition.coreml_partitioner",
    "executorch.backends.apple.coreml.compiler.coreml_preprocess",
    "coremltools",
)
# coremltools modules that draw tqdm progress bars, and the name they import tqdm as.
_PROGRESS_BARS = (
    ("coremltools.converters.mil.frontend.torch.ops", "_tqdm"),
    ("coremltools.converters.mil.mil.passes.pass_pipeline", "tqdm"),
)


def quiet() -> None:
    """Keep Core ML's chatter off the terminal unless ``LLMCORE_DEBUG=1`` (``--debug``):
    the partitioner logs every op it skips at INFO on its own logger, the preprocessor
    warns about the model specification version of every delegate, and coremltools draws
    progress bars for each conversion (tqdm reads ``TQDM_DISABLE`` only when it is first
    imported, so the bars are switched off where coremltools holds them)."""
    import functools
    import importlib

    if os.environ.get("LLMCORE_DEBUG") == "1":
        return
    level = max(logging.ERROR, logging.getLogger().level)
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(level)
    from tqdm import tqdm

    for module_name, attr in _PROGRESS_BARS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if getattr(module, attr, None) is tqdm:
            setattr(module, attr, functools.partial(tqdm, disable=True))


def make_partitioners(options: dict) -> list:
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner

    quiet()

    return [
        CoreMLPartitioner(
            compile_specs=compile_specs(options),
            take_over_mutable_buffer=options["cache_as_state"],
        )
    ]
