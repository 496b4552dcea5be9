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

ExecuTorch deprecated MPS in 1.2 in favour of Core ML (``coreml``), which takes dynamic
shapes and a KV cache, and removed it in 1.5 (pytorch/executorch#22181). This plugin
needs executorch 1.4.x: imported with a later one, it refuses with one line that says
what to use instead, and ``llmcore plugins`` lists it as failed. Programs lowered here
run on Apple GPUs only; the pip wheel's runtime has no MPS backend, so ``llmcore export``
skips its parity check and says so.
"""

from __future__ import annotations

import re
from importlib import metadata

LAST_EXECUTORCH = (1, 4)  # ExecuTorch 1.5 removed the MPS backend


def _refuse_without_mps() -> None:
    try:
        installed = metadata.version("executorch")
    except metadata.PackageNotFoundError:
        return  # a source tree on sys.path: let the MPS imports speak for themselves
    if tuple(int(p) for p in re.findall(r"\d+", installed)[:2]) > LAST_EXECUTORCH:
        raise ImportError(
            f"llmcore-mps needs executorch 1.4.x, and {installed} is installed: ExecuTorch 1.5 removed its MPS "
            "backend (pytorch/executorch#22181). Use the coreml plugin (--plugins coreml) on 1.5, or llmcore-mps "
            "in an environment with executorch 1.4.x (`make test-mps` sets one up in .venv-et14)."
        )


_refuse_without_mps()

from llmcore import hookimpl  # noqa: E402
from llmcore.records import Backend, EdgeSettings, Lazy, SourceTransform  # noqa: E402

__version__ = "0.1.0"

BACKEND = "mps"
RUNTIME_ID = "MPSBackend"
RUNS_ON = "Apple GPUs through Metal Performance Shaders (macOS, iOS), with an ExecuTorch runtime built with the MPS backend"


def _partitioners(options: dict) -> list:
    from llmcore_mps.partition import make_partitioner

    return [make_partitioner(options["fp16"])]


@hookimpl
def llmcore_partitioners() -> list[Backend]:
    return [
        Backend(
            name=BACKEND,
            description="MPS: Apple GPUs through Metal Performance Shaders (static shapes; executorch 1.4.x only: 1.5 removed MPS)",
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
            apply=Lazy("llmcore_mps.static", "apply"),
            order=60,
            backends=(BACKEND,),
            automatic=True,
            replaces=("kv-cache",),
        )
    ]
