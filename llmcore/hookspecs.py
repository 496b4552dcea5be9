"""The llmcore extension API: six hooks, one per kind of extension.

A plugin is a Python module (or object) that implements any of these hooks with
``@llmcore.hookimpl`` and is published under the entry-point group ``llmcore``::

    [project.entry-points.llmcore]
    mybackend = "llmcore_mybackend"

Each hook takes no arguments and returns a list of typed records from
:mod:`llmcore.records`. Hooks must be cheap: they describe what a plugin offers and hand
over factories; heavy imports happen inside those factories.

llmcore calls each plugin's implementation separately, so that every record is known to
come from one plugin. The order in which pluggy would call hooks (last registered first)
never decides anything: partitioners run in the order the user lists them, transforms and
passes by their ``order`` key.
"""

from __future__ import annotations

import pluggy

from llmcore.records import Backend, ModelFamily, PostPass, QuantizerRecipe, RuntimeLibrary, SourceTransform

PROJECT = "llmcore"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def llmcore_model_families() -> list[ModelFamily]:
    """Model architectures this plugin provides.

    Called when llmcore resolves ``--model NAME`` and when it lists plugins. Each
    :class:`~llmcore.records.ModelFamily` names its random-init configs, its checkpoint
    loaders (one per format it reads), and returns loaded models with their metadata
    (vocab size, max sequence length, BOS/EOS ids) and tokenizer.
    """


@hookspec
def llmcore_source_transforms() -> list[SourceTransform]:
    """Module-to-module rewrites applied before ``torch.export``.

    Each :class:`~llmcore.records.SourceTransform` says which families and backends it
    applies to and carries an explicit ``order``. A transform may change the calling
    convention (a KV cache) by setting flags on the context it receives.
    """


@hookspec
def llmcore_quantizers() -> list[QuantizerRecipe]:
    """Named quantization recipes (``--quantize NAME``).

    A recipe is either a pt2e quantizer factory (prepare / calibrate / convert on the
    exported graph) or a source-level quantizer (a torchao config applied to the eager
    module), plus the backends it is meant for.
    """


@hookspec
def llmcore_partitioners() -> list[Backend]:
    """Backends this plugin can lower to (``--plugins NAME,...``).

    Each :class:`~llmcore.records.Backend` has a name, a factory that takes the user's
    options and returns ExecuTorch partitioners, and the edge compile settings it needs.
    """


@hookspec
def llmcore_post_passes() -> list[PostPass]:
    """Graph passes applied to the edge program before ``to_executorch``."""


@hookspec
def llmcore_runtime_libraries() -> list[RuntimeLibrary]:
    """Custom operator libraries that programs using their ops must load to run.

    Each :class:`~llmcore.records.RuntimeLibrary` lists the runtime operator names it
    registers (``"llmcore::rms_norm.out"``), a Python module whose import registers them
    with PyTorch and with the ExecuTorch runtime, and the path of its native library for
    runners without Python. A plugin that ships a custom kernel returns one here and a
    source transform that swaps modules for the op (see ``docs/custom-kernels.md``).

    The core then does the rest: an export whose graph calls one of ``ops`` records the
    library in the report (``runtime_libraries``) and in the program (the constant method
    ``get_runtime_libraries``: a list of library names), and
    :meth:`llmcore.runtime.Program.load` loads the libraries of installed plugins that
    provide operators the runtime lacks, before the program's methods load.
    """
