"""Read the Core ML models a `.pte` carries, with coremltools, on any OS.

A Core ML delegate's processed bytes are a directory flattened by ExecuTorch's
``executorchcoreml`` extension: ``lowered_module/`` holds ``model.mlpackage`` (or a
compiled ``model.mlmodelc``), ``metadata.json`` and the debug symbol map.
:func:`extract_models` restores those directories; :func:`load_spec` opens a package with
coremltools without compiling it (compiling and running need macOS), and
:func:`mil_operations` counts the operations of its ML program.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Union

RUNTIME_ID = "CoreMLBackend"


def delegate_payloads(pte: Union[bytes, Path, str], backend_id: str = RUNTIME_ID) -> list[bytes]:
    """The processed bytes of every delegate of ``backend_id``, in program order."""
    from llmcore.testing.payloads import delegate_payloads as payloads

    return [data for bid, data in payloads(pte) if bid == backend_id]


def extract_models(pte: Union[bytes, Path, str], dest: Union[Path, str]) -> list[Path]:
    """Write each Core ML delegate's directory under ``dest/<n>/``; returns the model
    packages (``.../lowered_module/model.mlpackage``) in program order."""
    from executorch.backends.apple.coreml import executorchcoreml

    dest = Path(dest)
    models = []
    for n, data in enumerate(delegate_payloads(pte)):
        folder = dest / str(n)
        folder.mkdir(parents=True, exist_ok=True)
        if not executorchcoreml.unflatten_directory_contents(data, str(folder)):
            raise ValueError(f"Core ML delegate {n} could not be unpacked")
        found = sorted(folder.rglob("*.mlpackage")) or sorted(folder.rglob("*.mlmodelc"))
        if not found:
            raise ValueError(f"Core ML delegate {n} holds no model package: {sorted(p.name for p in folder.rglob('*'))}")
        models.append(found[0])
    return models


def load_spec(package: Union[Path, str]):
    """The protobuf spec of a Core ML model package (no compilation)."""
    import coremltools as ct

    return ct.models.MLModel(str(package), skip_model_load=True).get_spec()


def mil_operations(spec) -> Counter:
    """How many operations of each type the ML program's functions hold (nested blocks
    included)."""
    counts: Counter = Counter()

    def visit(block) -> None:
        for op in block.operations:
            counts[op.type] += 1
            for inner in op.blocks:
                visit(inner)

    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            visit(block)
    return counts
