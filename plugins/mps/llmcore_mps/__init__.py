"""MPS for llmcore: ExecuTorch's Metal Performance Shaders delegate (Apple GPUs).

Provides

* the ``mps`` backend: ExecuTorch's ``MPSPartitioner``, restricted to statically shaped
  nodes (:mod:`llmcore_mps.partition`), with the edge setting MPS needs
  (``_skip_dim_order``: otherwise ``_clone_dim_order`` ops, which MPS does not take,
  split the graph into many partitions);
* the ``mps-static-length`` source transform, automatic whenever ``mps`` is selected: the
  model runs on ``max_seq_len`` padded positions with a finite causal mask, so that MPS
  sees static shapes while the program keeps the dynamic ``tokens[1, T]`` interface
  (:mod:`llmcore_mps.static`). It replaces ``kv-cache``: MPS programs have no cache.

ExecuTorch marks MPS as deprecated in favour of Core ML (``coreml``), which takes dynamic
shapes and a KV cache; MPS is here for programs that must use MPSGraph. Programs lowered
here run on Apple GPUs only; the pip wheel's runtime has no MPS backend, so ``llmcore
export`` skips its parity check and says so.
"""

from __future__ import annotations

from llmcore import hookimpl
from llmcore.records import Backend, EdgeSettings, SourceTransform

__version__ = "0.1.0"

BACKEND = "mps"
RUNTIME_ID = "MPSBackend"
RUNS_ON = "Apple GPUs through Metal Performance Shaders (macOS, iOS), with an ExecuTorch runtime built with the MPS backend"


def _partitioners(options: dict) -> list:
    from llmcore_mps.partition import make_partitioner

    return [make_partitioner(options["fp16"])]


def _static_length(module, context):
    from llmcore_mps.static import apply

    return apply(module, context)


@hookimpl
def llmcore_partitioners() -> list[Backend]:
    return [
        Backend(
            name=BACKEND,
            description="MPS: Apple GPUs through Metal Performance Shaders (static shapes; deprecated upstream for Core ML)",
            partitioners=_partitioners,
            edge=EdgeSettings(check_ir_validity=False, skip_dim_order=True),
            runtime_id=RUNTIME_ID,
            runs_on=RUNS_ON,
            options={"fp16": (bool, False, "convert the MPS graph to fp16 (weights and activations)")},
        )
    ]


@hookimpl
def llmcore_source_transforms() -> list[SourceTransform]:
    return [
        SourceTransform(
            name="mps-static-length",
            description="run the model on max_seq_len padded positions with a finite causal mask, so MPS sees static "
            "shapes; no KV cache (replaces kv-cache)",
            apply=_static_length,
            order=60,
            backends=(BACKEND,),
            automatic=True,
            replaces=("kv-cache",),
        )
    ]
