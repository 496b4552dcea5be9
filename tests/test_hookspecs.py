"""Each hook's ``Example::`` in llmcore/hookspecs.py is a working plugin: run as a module, it
registers without failures and its hook returns records of the hook's kind."""

from __future__ import annotations

import inspect
import textwrap
import types

import pytest

from llmcore import hookspecs
from llmcore.plugins import KINDS, load_registry

HOOKS = {hook: (kind, record) for kind, (hook, record, _, _) in KINDS.items()}


def example(hook: str) -> str:
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert "Example::" in doc, f"{hook} has no Example:: in its docstring"
    return textwrap.dedent(doc.split("Example::", 1)[1]).strip() + "\n"


def test_every_hookspec_is_a_hook_the_registry_knows():
    specs = {name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("llmcore_")}
    assert specs == set(HOOKS)


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_the_example_is_a_working_plugin(hook, monkeypatch):
    monkeypatch.setenv("LLMCORE_LOAD_PLUGINS", "")
    module = types.ModuleType(f"example_{hook}")
    exec(compile(example(hook), f"<{hook} example>", "exec"), module.__dict__)
    registry = load_registry(extra_plugins=[("example", module)])
    assert registry.failures == []
    plugin = next(p for p in registry.plugins if p.name == "example")
    kind, record_type = HOOKS[hook]
    assert plugin.hooks == [hook] and plugin.provides[kind]
    for name in plugin.provides[kind]:
        assert isinstance(registry.get(kind, name, stage="test").record, record_type)


def test_the_transform_example_rewrites_a_model():
    from torch import nn

    module = types.ModuleType("example")
    exec(example("llmcore_source_transforms"), module.__dict__)
    (transform,) = module.llmcore_source_transforms()
    model = transform.apply(nn.Sequential(nn.Linear(2, 2), nn.GELU()), None)
    assert model[1].approximate == "tanh"


def test_the_quantizer_example_quantizes():
    import torch
    from torch import nn

    module = types.ModuleType("example")
    exec(example("llmcore_quantizers"), module.__dict__)
    (recipe,) = module.llmcore_quantizers()
    model = recipe.source_quantize(nn.Sequential(nn.Linear(32, 32)), {})
    assert type(model[0].weight).__name__ != "Parameter"  # a torchao quantized tensor
    assert model(torch.randn(1, 32)).shape == (1, 32)


def test_the_command_example_lists_a_programs_methods(exports, capsys):
    import argparse

    module = types.ModuleType("example")
    exec(example("llmcore_commands"), module.__dict__)
    (command,) = module.llmcore_commands()
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert command.run(parser.parse_args([str(exports("xnnpack").pte), "--delegated"])) == 0
    (line,) = capsys.readouterr().out.splitlines()  # only forward holds a delegate
    assert line.startswith("forward: ") and line.endswith(" delegates") and " 0 delegates" not in line
