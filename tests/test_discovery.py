"""Plugin discovery: broken plugins are skipped, conflicts name both packages, the
allowlist restricts loading, partitioner order follows --plugins, not pluggy, and listing
plugins imports no backend (their factories import it, ``Lazy`` ones when called)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import subprocess
import sys
from typing import Iterator

import pytest

from llmcore.errors import LlmcoreError, PluginConflictError
from llmcore.plugins import BUILTIN_PLUGINS, KINDS, load_registry
from llmcore.records import Lazy

import fakeplugins
from fakeplugins import (
    BackendPlugin,
    BadHookPlugin,
    BadNamePlugin,
    MisspeltHookPlugin,
    RecipePlugin,
    install_fake_distribution,
)

BROKEN = "raise ImportError('simulated: missing native library libfoo.so')\n"
CLAIMS_XNNPACK = """
from llmcore import hookimpl
from llmcore.records import Backend

@hookimpl
def llmcore_partitioners():
    return [Backend(name="xnnpack", description="impostor", partitioners=lambda o: [])]
"""


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return site, env


def test_installed_plugins_are_found():
    registry = load_registry()
    assert {"nanogpt", "xnnpack"} <= {p.name for p in registry.plugins}
    xnn = next(p for p in registry.plugins if p.name == "xnnpack")
    assert xnn.distribution == "llmcore-xnnpack" and xnn.version
    assert "llmcore_partitioners" in xnn.hooks
    assert xnn.provides["backends"] == ["xnnpack"]


def test_plugin_that_fails_to_import_is_reported_and_skipped(fake_site, cli):
    site, env = fake_site
    install_fake_distribution(site, "llmcore-broken", "broken", "llmcore_broken", BROKEN)
    result = cli("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    failed = {f["name"]: f["error"] for f in data["failed"]}
    assert "libfoo.so" in failed["broken"]
    assert {"nanogpt", "xnnpack"} <= {p["name"] for p in data["plugins"]}


def test_export_that_does_not_use_a_broken_plugin_still_works(fake_site, cli, tmp_path):
    site, env = fake_site
    install_fake_distribution(site, "llmcore-broken", "broken", "llmcore_broken", BROKEN)
    out = tmp_path / "tiny.pte"
    result = cli("export", "--model", "nanogpt", "--config", "tiny", "--quiet", "-o", str(out), env=env)
    assert result.returncode == 0, result.stderr
    assert out.is_file()


def test_two_plugins_claiming_one_backend_is_an_error_naming_both(fake_site, cli, tmp_path):
    site, env = fake_site
    install_fake_distribution(site, "llmcore-impostor", "impostor", "llmcore_impostor", CLAIMS_XNNPACK)
    out = tmp_path / "x.pte"
    result = cli("export", "--model", "nanogpt", "--config", "tiny", "--plugins", "xnnpack", "-o", str(out), env=env)
    assert result.returncode == 2
    assert "llmcore-impostor" in result.stderr and "llmcore-xnnpack" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_conflicting_recipe_names(monkeypatch):
    registry = load_registry(extra_plugins=[("a", RecipePlugin("same")), ("b", RecipePlugin("same"))])
    with pytest.raises(PluginConflictError, match="more than one plugin"):
        registry.get("quantizers", "same", stage="quantize")


def test_allowlist_restricts_loading(monkeypatch):
    monkeypatch.setenv("LLMCORE_LOAD_PLUGINS", "nanogpt")
    registry = load_registry()
    assert [p.name for p in registry.plugins if p.distribution != "llmcore"] == ["nanogpt"]
    with pytest.raises(LlmcoreError, match="unknown backend 'xnnpack'"):
        registry.get("backends", "xnnpack", stage="lower")


def test_allowlist_naming_a_missing_plugin_is_reported(monkeypatch):
    monkeypatch.setenv("LLMCORE_LOAD_PLUGINS", "nanogpt,nosuchplugin")
    registry = load_registry()
    assert any(f.name == "nosuchplugin" and "not installed" in f.error for f in registry.failures)


def test_hook_returning_wrong_type_is_reported(monkeypatch):
    monkeypatch.setenv("LLMCORE_LOAD_PLUGINS", "")
    registry = load_registry(extra_plugins=[("bad", BadHookPlugin())])
    assert "bad" not in [p.name for p in registry.plugins]
    assert "expected llmcore.records.Backend" in registry.failures[0].error


def test_a_misspelt_hook_is_reported_naming_it(monkeypatch):
    monkeypatch.setenv("LLMCORE_LOAD_PLUGINS", "")
    registry = load_registry(extra_plugins=[("typo", MisspeltHookPlugin()), ("ok", RecipePlugin("fine"))])
    assert [p.name for p in registry.plugins] == [*BUILTIN_PLUGINS, "ok"]  # skipped; the others load
    (failure,) = registry.failures
    assert failure.name == "typo"
    assert "llmcore_partitioner (did you mean llmcore_partitioners?)" in failure.error
    assert "not an llmcore hook" in failure.error
    assert "typo-recipe" not in registry.names("quantizers")  # nothing of a skipped plugin is used
    assert not registry.manager.get_plugin("typo")


def test_a_record_name_the_cli_cannot_select_is_reported(monkeypatch):
    monkeypatch.setenv("LLMCORE_LOAD_PLUGINS", "")
    registry = load_registry(extra_plugins=[("commas", BadNamePlugin()), ("ok", BackendPlugin("fine"))])
    assert registry.names("backends") == ["fine"]
    (failure,) = registry.failures
    assert failure.name == "commas" and "\n" not in failure.error
    assert "[plugins/commas] backend name 'my,backend' is not valid" in failure.error
    assert "rename it, e.g. 'my-backend'" in failure.error


@pytest.mark.parametrize("name", ["", "two words", "a,b", "tab\there", "trailing "])
def test_records_refuse_names_with_commas_or_whitespace(name):
    from llmcore.records import Backend, CheckpointLoader, ModelFamily, PostPass, QuantizerRecipe, RuntimeLibrary
    from llmcore.records import SourceTransform

    builders = {
        "backend": lambda: Backend(name, "d", partitioners=lambda o: []),
        "model family": lambda: ModelFamily(name, "d", configs={}, build_random=lambda c, o: None),
        "checkpoint loader": lambda: CheckpointLoader(name, "d", matches=lambda p: False, load=lambda p, o: None),
        "source transform": lambda: SourceTransform(name, "d", apply=lambda m, c: m),
        "quantizer recipe": lambda: QuantizerRecipe(name, "d", source_quantize=lambda m, o: m),
        "post-pass": lambda: PostPass(name, "d", create=lambda: None),
        "runtime library": lambda: RuntimeLibrary(name, "d", ops=()),
    }
    for kind, build in builders.items():
        with pytest.raises(LlmcoreError) as caught:
            build()
        line = caught.value.one_line()
        assert line.startswith(f"[plugins] {kind} name {name!r} is not valid") and "\n" not in line


def test_builtin_kv_cache_transforms_always_load(monkeypatch):
    monkeypatch.setenv("LLMCORE_LOAD_PLUGINS", "")
    registry = load_registry()
    assert {"kv-cache", "kv-cache-static"} <= set(registry.names("transforms"))


@pytest.mark.parametrize("order", [["alpha", "beta"], ["beta", "alpha"]])
def test_partitioner_order_follows_the_user_not_pluggy(monkeypatch, tmp_path, order):
    from llmcore.pipeline import export
    from llmcore.recipe import ExportOptions

    monkeypatch.setenv("LLMCORE_LOAD_PLUGINS", "nanogpt")
    # alpha registers first, so pluggy alone would call beta's hook first (LIFO).
    registry = load_registry(extra_plugins=[("alpha", BackendPlugin("alpha")), ("beta", BackendPlugin("beta"))])
    fakeplugins.CALLS.clear()
    options = ExportOptions(model="nanogpt", config="tiny", plugins=order, output=str(tmp_path / "o.pte"), quiet=True)
    result = export(options, registry)
    assert fakeplugins.CALLS == order
    assert [b["name"] for b in result.report["backends"]] == order


def test_a_lazy_factory_imports_its_module_only_when_called(fake_site, monkeypatch):
    site, _ = fake_site
    (site / "lazy_target.py").write_text("def scale(x, *, by=2):\n    return x * by\n")
    monkeypatch.delitem(sys.modules, "lazy_target", raising=False)
    factory = Lazy("lazy_target", "scale")
    assert "lazy_target" not in sys.modules
    assert factory(3, by=3) == 9 and "lazy_target" in sys.modules


def _lazy_factories(value) -> Iterator[Lazy]:
    """The :class:`Lazy` factories a record holds (loaders of a family, a partial's function)."""
    if isinstance(value, Lazy):
        yield value
    elif isinstance(value, functools.partial):
        yield from _lazy_factories(value.func)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for found in dataclasses.fields(value):
            yield from _lazy_factories(getattr(value, found.name))
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _lazy_factories(item)


def test_every_lazy_factory_of_the_installed_plugins_names_a_function_its_module_defines():
    """A ``Lazy`` imports nothing until an export calls it, so a misspelt module or function
    would show only then: every installed plugin's is resolved here."""
    registry = load_registry()
    factories = {
        factory
        for kind in KINDS
        for name in registry.names(kind)
        for factory in _lazy_factories(registry.get(kind, name, stage="test").record)
    }
    assert Lazy("llmcore_xnnpack.partition", "partitioners") in factories
    unresolved = []
    for factory in factories:
        try:
            module = importlib.import_module(factory.module)
        except ModuleNotFoundError as missing:
            if not f"{factory.module}.".startswith(f"{missing.name}."):
                continue  # the module is there; a dependency of it is not installed here
            module = None
        if not callable(getattr(module, factory.name, None)):
            unresolved.append(factory)
    assert unresolved == []


def test_listing_the_installed_plugins_imports_no_backend():
    code = (
        "import sys\nfrom llmcore.plugins import load_registry\nload_registry()\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'executorch', 'torchao', 'coremltools', 'gguf', "
        "'transformers', 'safetensors'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
