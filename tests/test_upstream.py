"""The patches to ExecuTorch's and torch's internals (llmcore/upstream.py): each written for
the installed releases, refused loudly on any other, and turned off by the switch.

That the export writes the same bytes with every patch on and every patch off is
``plugins/xnnpack/tests/test_lowering.py``'s comparison; the XNNPACK plugin's own patches
are checked against the installed releases in its tests too.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from llmcore import upstream
from llmcore.errors import LlmcoreError

CORE = [p for p in upstream.PATCHES.values() if p.module == upstream.__name__]


@pytest.mark.parametrize("patch", CORE, ids=lambda p: p.name)
def test_each_patch_was_written_for_the_installed_releases(patch):
    """Fails on an ExecuTorch or torch upgrade, once per patch to look at again: a range
    left, or a function it replaces or relies on gone or rewritten (the module docstring
    of llmcore/upstream.py says what to do)."""
    assert not upstream.problems(patch), f"{patch.name}: " + "; ".join(upstream.problems(patch))


def test_the_core_lists_every_patch_the_pipeline_applies():
    from llmcore.pipeline import lower

    names = {p.name for p in CORE}
    assert set(lower.LOWERING_PATCHES) <= names
    assert {"recorded_delegate_outputs", "quant_fusion_only_where_quantized", "decomposed_in_one_retrace",
            "fused_edge_passes"} <= names
    for patch in CORE:
        assert patch.requires and patch.why and (patch.replaces or patch.relies_on), patch.name
        assert all(digests for digests in patch.relies_on.values()), patch.name


def _another_executorch(monkeypatch, version: str = "1.6.0") -> None:
    installed = upstream.installed_version
    monkeypatch.setattr(upstream, "installed_version", lambda p: version if p == "executorch" else installed(p))


def test_out_of_range_is_one_line_naming_the_patch_its_range_the_version_and_the_fix(monkeypatch):
    from executorch.exir import lowered_backend_module

    _another_executorch(monkeypatch)
    original = lowered_backend_module.legalize_graph
    with pytest.raises(upstream.UpstreamPatchError) as raised:
        with upstream.applied("legalize_in_place"):
            pass
    line = str(raised.value)
    assert "\n" not in line
    assert "'legalize_in_place'" in line and "executorch>=1.4.1,<1.6" in line
    assert "executorch 1.6.0 is installed" in line
    assert f"{upstream.SWITCH}=legalize_in_place" in line and "llmcore/upstream.py" in line
    assert lowered_backend_module.legalize_graph is original  # not applied, and not skipped either


def test_an_export_on_another_executorch_stops_at_the_first_patch(monkeypatch):
    """Lowering does not go on silently unpatched: it stops with the patch's line, in the
    lower stage."""
    from llmcore.pipeline import lower
    from llmcore.plugins import PluginInfo, Provided
    from llmcore.records import Backend

    xnnpack = pytest.importorskip("executorch.backends.xnnpack.partition.xnnpack_partitioner")
    _another_executorch(monkeypatch, "1.4.0")
    backend = Backend(name="cpu", description="XNNPACK", partitioners=lambda o: [xnnpack.XnnpackPartitioner()])
    exported = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(LlmcoreError) as raised:
        lower.lower(exported, [(Provided(backend, PluginInfo("test", "test")), {})], {})
    assert raised.value.stage == "lower"
    assert f"upstream patch {lower.LOWERING_PATCHES[0]!r}" in str(raised.value)
    assert "executorch 1.4.0 is installed" in str(raised.value)


def test_the_switch_turns_patches_off_even_out_of_range(monkeypatch):
    from executorch.exir import lowered_backend_module

    original = lowered_backend_module.legalize_graph
    monkeypatch.setenv(upstream.SWITCH, " legalize_in_place , type_hints_read_once")
    assert upstream.switched_off() == {"legalize_in_place", "type_hints_read_once"}
    _another_executorch(monkeypatch)
    assert not upstream.active("legalize_in_place")
    with upstream.applied("legalize_in_place") as value:
        assert value is None and lowered_backend_module.legalize_graph is original
    with pytest.raises(upstream.UpstreamPatchError):  # the others still apply, and refuse
        upstream.active("constant_inputs_listed_once")
    monkeypatch.setenv(upstream.SWITCH, "all")
    assert not any(upstream.active(p.name) for p in upstream.PATCHES.values())


def _snapshot(patch) -> list:
    values = [upstream.resolve(target) for target in patch.replaces]
    return [dict(v) if isinstance(v, dict) else v for v in values]


def _same(before: list, after: list) -> list[bool]:
    return [a == b if isinstance(a, dict) else a is b for a, b in zip(before, after)]


@pytest.mark.parametrize("patch", [p for p in CORE if p.apply is not None], ids=lambda p: p.name)
def test_a_patch_changes_what_it_replaces_only_while_applied_and_nothing_when_off(patch, monkeypatch):
    before = _snapshot(patch)
    with upstream.applied(patch.name):
        assert not any(_same(before, _snapshot(patch))), patch.replaces
    assert all(_same(before, _snapshot(patch)))
    monkeypatch.setenv(upstream.SWITCH, patch.name)
    with upstream.applied(patch.name):
        assert all(_same(before, _snapshot(patch)))


def test_a_rewritten_or_missing_upstream_function_is_caught_inside_the_range():
    record = upstream.PATCHES["legalize_in_place"]
    target = next(iter(record.relies_on))
    rewritten = dataclasses.replace(record, relies_on={**record.relies_on, target: ("0123456789abcdef",)})
    found = upstream.problems(rewritten)
    assert len(found) == 1 and target in found[0] and upstream.digest(target) in found[0]
    gone = "executorch.exir.lowered_backend_module:no_such_function"
    missing = dataclasses.replace(record, relies_on={gone: ("0123456789abcdef",)}, replaces=(gone,))
    assert [gone in f and "does not have" in f for f in upstream.problems(missing)] == [True, True]


def test_digests_read_the_upstream_file_not_the_object_a_patch_put_there():
    from llmcore.pipeline.lower import LeanDependencyViewer

    target = "torch.fx.passes.infra.partitioner:_DependencyViewer"
    expected = upstream.digest.__wrapped__(target)
    with upstream.applied("lean_dependency_viewers"):
        assert upstream.resolve(target) is LeanDependencyViewer
        assert upstream.digest.__wrapped__(target) == expected


def test_a_second_record_of_a_name_is_refused_naming_both_places():
    record = upstream.PATCHES["legalize_in_place"]
    assert upstream.register(record) is record  # the same record again: nothing happens
    with pytest.raises(LlmcoreError, match="llmcore.upstream and in elsewhere"):
        upstream.register(dataclasses.replace(record, module="elsewhere"))
    assert upstream.PATCHES["legalize_in_place"] is record
    with pytest.raises(LlmcoreError, match="not valid"):
        dataclasses.replace(record, name="legalize in place")


def test_an_unknown_name_in_the_switch_is_warned_about_once(monkeypatch, caplog):
    monkeypatch.setenv(upstream.SWITCH, "legalize_in_place,legalise_in_place")
    monkeypatch.setattr(upstream, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="llmcore.upstream"):
        upstream.warn_unknown_switch_names()
        upstream.warn_unknown_switch_names()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "'legalise_in_place'" in warnings[0] and "legalize_in_place" in warnings[0]
