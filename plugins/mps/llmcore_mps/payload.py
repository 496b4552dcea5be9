"""Read the MPS graphs a `.pte` carries, on any OS.

An MPS delegate's processed bytes are a 24-byte header (4 bytes, the magic ``MP00``, the
offset and size of the constant segment), the ``MPSGraph`` flatbuffer and the constants.
:func:`mps_graphs` decodes the flatbuffers with the schema that ships in ExecuTorch's MPS
package and the ``flatc`` ExecuTorch bundles, into JSON-like dicts: ``mps_nodes`` (the
operations, their type in ``mpsnode_union_type``) and ``mps_values`` (tensors with
their fixed ``dims``).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from importlib import resources
from pathlib import Path
from typing import Union

RUNTIME_ID = "MPSBackend"
MAGIC = b"MP00"


def _flatbuffer(data: bytes) -> bytes:
    if data[4:8] != MAGIC:
        raise ValueError(f"not an MPS delegate payload (magic {data[4:8]!r})")
    segment_offset = int.from_bytes(data[8:16], "little")
    return data[24:segment_offset]


def mps_graphs(pte: Union[bytes, Path, str]) -> list[dict]:
    """The decoded ``MPSGraph`` of every MPS delegate, in program order."""
    from executorch.exir._serialize._flatbuffer import _flatc_decompile

    from llmcore.testing.payloads import delegate_payloads

    schema = resources.files("executorch.backends.apple.mps.serialization").joinpath("schema.fbs").read_bytes()
    graphs = []
    for backend_id, data in delegate_payloads(pte):
        if backend_id != RUNTIME_ID:
            continue
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "schema.fbs").write_bytes(schema)
            (Path(d) / "graph.bin").write_bytes(_flatbuffer(data))
            _flatc_decompile(d, str(Path(d) / "schema.fbs"), str(Path(d) / "graph.bin"), ["--raw-binary"])
            graphs.append(json.loads((Path(d) / "graph.json").read_text()))
    return graphs


def mps_operators(pte: Union[bytes, Path, str]) -> Counter:
    """How many times each MPS operation appears in a program's MPS graphs."""
    counts: Counter = Counter()
    for graph in mps_graphs(pte):
        counts.update(node["mpsnode_union_type"] for node in graph["mps_nodes"])
    return counts
