"""The contracts backend plugins rely on, declared and kept.

* The KV-cache attention forms (``llmcore.kv_cache``): each record says what its class is
  and does, and the classes do it; plugins import them from there and never from the core's
  implementation (``llmcore.builtins``).
* The calling convention: a transform that changes it returns it (``Transformed``), the
  transform stage hands it on; nothing sets it on the context.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from llmcore import kv_cache
from llmcore.records import CallingConvention, KV_CACHE_ATTRIBUTES, SourceTransform, Transformed, TransformContext

ROOT = Path(__file__).resolve().parents[1]


def _plugin_files() -> list[Path]:
    """Every Python file of the plugins and the examples (their packages and their tests)."""
    return sorted(p for top in ("plugins", "examples") for p in (ROOT / top).rglob("*.py")
                  if "__pycache__" not in p.parts and ".egg-info" not in str(p))


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import in the file, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append((node.module or "", [alias.name for alias in node.names]))
    return found


def test_plugins_use_only_the_declared_kv_cache_api():
    files = _plugin_files()
    assert any(p.match("plugins/coreml/*/attention.py") for p in files)  # the walk sees the plugins
    internal, undeclared, users = [], [], set()
    for path in files:
        for module, names in _imports(path):
            where = str(path.relative_to(ROOT))
            if module == "llmcore.builtins" or module.startswith("llmcore.builtins."):
                internal.append(f"{where}: {module}")
            if module == "llmcore" and "builtins" in names:
                internal.append(f"{where}: llmcore.builtins")
            if module == "llmcore.kv_cache":
                users.add(path.parts[len(ROOT.parts) + 1])
                undeclared.extend(f"{where}: {n}" for n in names if n not in kv_cache.__all__)
    assert internal == [], "plugins import the core's implementation instead of llmcore.kv_cache"
    assert undeclared == []
    assert {"coreml", "qnn", "vulkan"} <= users


def test_the_walk_finds_an_import_inside_a_function(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("def f():\n    from llmcore.builtins.kv_cache import StaticKVAttention\n")
    assert _imports(sneaky) == [("llmcore.builtins.kv_cache", ["StaticKVAttention"])]


def test_each_form_names_its_class_and_its_transform():
    from llmcore.plugins import load_registry

    transforms = {p.record.name: p.record for p in load_registry().all("transforms")}
    assert [f.name for f in kv_cache.kv_cache_forms()] == ["kv-cache", "kv-cache-static"]
    for form in kv_cache.FORMS:
        cls = getattr(kv_cache, form.module_class.partition(":")[2])
        assert cls is form.module_type() and issubclass(cls, torch.nn.Module)
        assert transforms[form.name].description == form.description and transforms[form.name].order == 50
    with pytest.raises(AttributeError):
        kv_cache.NoSuchAttention


def _transformed(form):
    from llmcore.testing.conformance import transformed_tiny

    extra = {"transforms": [form.name]} if form is kv_cache.STATIC else {}
    return transformed_tiny("nanogpt", [], max_seq_len=32, **extra)


@pytest.mark.parametrize("form", kv_cache.FORMS, ids=lambda f: f.name)
def test_a_form_has_its_attributes_layout_ops_and_convention(form):
    from llmcore.pipeline import capture
    from llmcore.runtime.libraries import graph_operators

    module, context, applied = _transformed(form)
    assert form.name in applied
    cls = form.module_type()
    layers = [m for m in module.modules() if isinstance(m, cls)]
    assert layers and not [m for m in module.modules() if type(m).__name__.endswith("KVAttention") and
                           not isinstance(m, cls)]
    rank = form.cache_layout.count(",") + 1
    for layer in layers:
        assert all(hasattr(layer, a) for a in KV_CACHE_ATTRIBUTES), [a for a in KV_CACHE_ATTRIBUTES if not hasattr(layer, a)]
        assert layer.k_cache.dim() == rank and layer.v_cache.shape == layer.k_cache.shape
        assert layer.k_cache.shape[-2:] == (layer.n_kv_heads, layer.head_dim)
        assert layer.k_cache.shape[-3] == (layer.slots or layer.capacity) == 32
    assert context.convention == CallingConvention(
        use_kv_cache=True, use_sdpa_with_kv_cache="llama::custom_sdpa" in form.custom_ops)
    inputs = capture.example_inputs([1, 2, 3], True)
    ops = graph_operators(capture.capture(module, inputs, 32, True, family="nanogpt"))
    llama = {op for op in ops if op.startswith("llama::")}
    assert llama <= set(form.custom_ops) and (bool(llama) == bool(form.custom_ops)), llama


def test_a_transform_returns_the_convention_and_the_next_one_reads_it():
    from llmcore.pipeline.transform import apply_transforms
    from llmcore.plugins import PluginInfo, Provided
    from llmcore.records import LoadedModel, ModelMetadata

    seen = []

    def add_cache(module, context):
        return Transformed(module, dataclasses.replace(context.convention, use_kv_cache=True, max_tokens_per_call=8))

    def look(module, context):
        seen.append(context.convention)

    def drop_sdpa(module, context):
        return Transformed(torch.nn.Identity(), dataclasses.replace(context.convention, use_sdpa_with_kv_cache=False))

    info = PluginInfo("test", "test")
    transforms = [Provided(SourceTransform(name=n, description=n, apply=f), info)
                  for n, f in (("add", add_cache), ("look", look), ("drop", drop_sdpa))]
    meta = ModelMetadata(vocab_size=4, max_seq_len=16)
    loaded = LoadedModel(torch.nn.Linear(2, 2), meta)
    start = CallingConvention(use_sdpa_with_kv_cache=True)
    context = TransformContext(meta, 16, "tiny", (), convention=start)
    applied, convention = apply_transforms(loaded, transforms, context)
    assert applied == ["add", "look", "drop"]
    assert seen == [CallingConvention(True, True, 8)]
    assert convention == CallingConvention(True, False, 8) and isinstance(loaded.module, torch.nn.Identity)
    assert context.convention == start  # the context handed in is not changed


def test_the_context_refuses_to_be_set():
    context = TransformContext(None, 16, "tiny", ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.use_kv_cache = True
    assert context.use_kv_cache is False and context.max_tokens_per_call is None
