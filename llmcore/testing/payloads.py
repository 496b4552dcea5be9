"""What a `.pte` hands to its delegates: each delegate's backend id and processed bytes.

Backends' own tools can read those bytes on any OS even when the runtime cannot run them
(coremltools opens a Core ML model package, the Vulkan serialiser decodes its graph), so
a backend's tests can check the payload, not only the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union


def delegate_payloads(pte: Union[bytes, bytearray, Path, str]) -> list[tuple[str, bytes]]:
    """``(backend_id, processed_bytes)`` for every delegate of every method, in order."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    data = bytes(pte) if isinstance(pte, (bytes, bytearray)) else Path(pte).read_bytes()
    pte_file = deserialize_pte_binary(data)
    program = getattr(pte_file, "program", pte_file)
    out = []
    for plan in program.execution_plan:
        for delegate in plan.delegates:
            # deserialize_pte_binary moves segment data back inline.
            out.append((delegate.id, bytes(program.backend_delegate_data[delegate.processed.index].data)))
    return out
