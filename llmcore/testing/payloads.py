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
    from llmcore.runtime import pte as reader

    return reader.delegate_payloads(pte if isinstance(pte, (bytes, bytearray)) else Path(pte).read_bytes())
