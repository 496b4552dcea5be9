"""The llmcore extension API: seven hooks, one per kind of extension.

A plugin is a Python module (or object) that implements any of these hooks with
``@llmcore.hookimpl`` and is published under the entry-point group ``llmcore``::

    [project.entry-points.llmcore]
    mybackend = "llmcore_mybackend"

Each hook takes no arguments and returns a list of typed records from
:mod:`llmcore.records`. Hooks must be cheap: they describe what a plugin offers and hand
over factories; heavy imports happen inside those factories
(:class:`~llmcore.records.Lazy` is one that imports a module's function when called).

llmcore calls each plugin's implementation separately, so that every record is known to
come from one plugin. The order in which pluggy would call hooks (last registered first)
never decides anything: partitioners run in the order the user lists them, transforms and
passes by their ``order`` key.

A ``@hookimpl`` whose name is not one of these hooks (a typo) makes its plugin a reported
failure, as does a record whose ``name`` is empty or holds a comma or whitespace. Each
hook's ``Example::`` is a complete plugin module; ``tests/test_hookspecs.py`` runs them.
"""

from __future__ import annotations

import pluggy

from llmcore.records import (
    Backend,
    Command,
    ModelFamily,
    PostPass,
    QuantizerRecipe,
    RuntimeLibrary,
    SourceTransform,
)

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

    Example::

        from llmcore import hookimpl
        from llmcore.records import CheckpointLoader, LoadedModel, ModelFamily, ModelMetadata


        def build_random(config, options):
            from tinylm import TinyLM, tokenizer  # the model's code, imported only when used

            model = TinyLM(n_layers={"tiny": 2, "small": 12}[config], seed=options.seed)
            return LoadedModel(model, ModelMetadata(vocab_size=256, max_seq_len=512), tokenizer())


        def load_checkpoint(path, options):
            from tinylm import load

            return load(path, dtype=options.dtype)


        @hookimpl
        def llmcore_model_families():
            return [
                ModelFamily(
                    name="tinylm",
                    description="a small decoder-only transformer",
                    configs={"tiny": "2 layers, random weights", "small": "12 layers, random weights"},
                    build_random=build_random,
                    loaders=[
                        CheckpointLoader(
                            name="tinylm-pt",
                            description="tinylm's .pt files",
                            matches=lambda path: path.suffix == ".pt",
                            load=load_checkpoint,
                        )
                    ],
                    default_config="tiny",
                )
            ]
    """


@hookspec
def llmcore_source_transforms() -> list[SourceTransform]:
    """Module-to-module rewrites applied before ``torch.export``.

    Each :class:`~llmcore.records.SourceTransform` says which families and backends it
    applies to and carries an explicit ``order``. ``apply(module, context)`` returns the
    module; a transform that changes the calling convention (adds a KV cache, or swaps one
    for a form that calls other ops) returns a :class:`~llmcore.records.Transformed`: the
    module and its :class:`~llmcore.records.CallingConvention` from then on, which the
    pipeline merges (the next transform reads it as ``context.convention``).

    The core's own ``kv-cache`` and ``kv-cache-static`` transforms (``order`` 50) put the
    cached attention forms of :mod:`llmcore.kv_cache` in place of every
    :class:`llmcore.modules.CausalAttention`; each is a :class:`~llmcore.records.KVCacheForm`
    record (its class, its cache's layout, the ExecuTorch custom ops it calls). A backend's
    transform ordered after them may find those classes, imported from ``llmcore.kv_cache``,
    and swap them for its own.

    Example::

        from torch import nn

        from llmcore import hookimpl
        from llmcore.modules import replace_modules
        from llmcore.records import SourceTransform


        def tanh_gelu(module, context):
            replace_modules(module, nn.GELU, lambda gelu: nn.GELU(approximate="tanh"))
            return module


        @hookimpl
        def llmcore_source_transforms():
            return [
                SourceTransform(
                    name="tanh-gelu",
                    description="GELU computed with its tanh approximation",
                    apply=tanh_gelu,
                    order=120,
                )
            ]
    """


@hookspec
def llmcore_quantizers() -> list[QuantizerRecipe]:
    """Named quantization recipes (``--quantize NAME``).

    A recipe is either a pt2e quantizer factory (prepare / calibrate / convert on the
    exported graph) or a source-level quantizer (a torchao config applied to the eager
    module), plus the backends it is meant for.

    Example::

        from llmcore import hookimpl
        from llmcore.records import QuantizerRecipe


        def int8_weights(module, options):
            from torchao.quantization import Int8WeightOnlyConfig, quantize_

            quantize_(module, Int8WeightOnlyConfig())
            return module


        @hookimpl
        def llmcore_quantizers():
            return [
                QuantizerRecipe(
                    name="int8-weights",
                    description="int8 weights, float activations (torchao)",
                    source_quantize=int8_weights,
                )
            ]
    """


@hookspec
def llmcore_partitioners() -> list[Backend]:
    """Backends this plugin can lower to (``--plugins NAME,...``).

    Each :class:`~llmcore.records.Backend` has a name, a factory that takes the user's
    options and returns ExecuTorch partitioners, and the edge compile settings it needs. A
    backend whose work is custom operators rather than a delegate (llmcore-kernels'
    ``kernels``) returns no partitioners and sets ``takes_modules``: it swaps the parts of the
    quantized eager module it runs before ``torch.export``, in the same ``--plugins`` order.

    Example::

        from llmcore import hookimpl
        from llmcore.records import Backend, EdgeSettings


        def partitioners(options):
            from my_npu_sdk.executorch import MyNpuPartitioner  # the SDK, only when exporting

            return [MyNpuPartitioner(precision=options["precision"])]


        @hookimpl
        def llmcore_partitioners():
            return [
                Backend(
                    name="my-npu",
                    description="My NPU, through its SDK's ExecuTorch delegate",
                    partitioners=partitioners,
                    edge=EdgeSettings(check_ir_validity=False),
                    runtime_id="MyNpuBackend",
                    runs_on="devices with My NPU",
                    options={"precision": (str, "fp16", "fp16 or int8")},
                )
            ]
    """


@hookspec
def llmcore_post_passes() -> list[PostPass]:
    """Graph passes applied to the edge program before ``to_executorch``.

    Each :class:`~llmcore.records.PostPass` creates its pass when an export selects one of
    its ``backends`` (every export, when it names none); passes run by ``order``.

    Example::

        from llmcore import hookimpl
        from llmcore.records import PostPass


        def create():
            from my_npu_sdk.executorch.passes import FuseActivationsPass

            return FuseActivationsPass()


        @hookimpl
        def llmcore_post_passes():
            return [
                PostPass(
                    name="my-npu-fuse-activations",
                    description="fold activations into the preceding convolution",
                    create=create,
                    backends=("my-npu",),
                )
            ]
    """


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

    Example::

        from llmcore import hookimpl
        from llmcore.records import RuntimeLibrary


        @hookimpl
        def llmcore_runtime_libraries():
            return [
                RuntimeLibrary(
                    name="my_kernels",
                    description="a fused RMSNorm kernel",
                    ops=("my_kernels::rms_norm.out",),
                    python_module="my_kernels.ops",
                )
            ]
    """


@hookspec
def llmcore_commands() -> list[Command]:
    """Subcommands of the ``llmcore`` command line.

    Called each time ``llmcore`` builds its parser: every :class:`~llmcore.records.Command`
    becomes ``llmcore NAME``, with the arguments its ``add_arguments`` adds and ``run``
    called with the parsed arguments. llmcore's own commands come through this hook too:
    ``export``, ``plugins`` and ``run`` from the core (``llmcore.builtins.commands``), and
    ``inspect``, ``profile``, ``eval``, ``matrix``, ``serve`` and ``chat`` from the
    applications (``llmcore.apps``). Two plugins giving the same name make ``llmcore NAME``
    an error that names both. A command whose ``needs`` are not installed fails in one line
    naming its ``extra``.

    Example::

        from llmcore import hookimpl
        from llmcore.records import Command


        def add_arguments(parser):
            parser.add_argument("pte", help="the .pte program")
            parser.add_argument("--delegated", action="store_true", help="only methods with delegates")


        def list_methods(args):
            from pathlib import Path

            from llmcore.runtime.pte import read_methods

            for method in read_methods(Path(args.pte).read_bytes()):
                if method.delegates or not args.delegated:
                    print(f"{method.name}: {len(method.operators)} operators, {len(method.delegates)} delegates")
            return 0


        @hookimpl
        def llmcore_commands():
            return [
                Command(
                    name="methods",
                    help="list a .pte's methods",
                    add_arguments=add_arguments,
                    run=list_methods,
                )
            ]
    """
