"""ExecuTorch's OpenVINO partitioner, for programs whose sequence length is dynamic.

llmcore exports every program with a dynamic number of tokens, so the edge graph reads
the length with ``sym_size.int`` nodes and reshapes with it. ExecuTorch's
``OpenvinoPartitioner`` does not take ``sym_size`` (its support table spells the op
differently from the edge graph), so the length reaches a delegate as a ``SymInt``
input, which OpenVINO's compile step cannot type (``'SymInt' object has no attribute
'type'``) and the export fails. The OpenVINO PyTorch frontend does convert
``aten.sym_size.int``: this partitioner puts those nodes into the delegates, which then
take only tensors, and read the length from them.

The upstream partitioner prints one "Op not supported" line per operator it leaves out;
those go to the export's operator table instead (ExecuTorch's delegation summary).
"""

from __future__ import annotations

import contextlib
import io

import torch
from executorch.backends.openvino.partitioner import OpenvinoPartitioner


class DynamicShapeOpenvinoPartitioner(OpenvinoPartitioner):
    def partition(self, exported_program):
        for node in exported_program.graph_module.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.sym_size.int:
                self._enabled_ops_by_name.add(node.name)
        with contextlib.redirect_stdout(io.StringIO()):
            return super().partition(exported_program)
