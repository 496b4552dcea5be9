"""The export's plan: every name resolved once, before a model is loaded, and handed to the
stages, which look nothing up themselves; an ExecuTorch outside a patch's range stops it
there; the architecture -> plugin catalogue lives in a data file, not in the core's code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import llmcore
from llmcore import upstream
from llmcore.errors import LlmcoreError
from llmcore.plugins import load_registry
from llmcore.recipe import ExportOptions

ROOT = Path(__file__).resolve().parents[1]


def _options(tmp_path, **given) -> ExportOptions:
    return ExportOptions(**{"model": "nanogpt", "config": "tiny", "plugins": ["xnnpack"],
                            "output": str(tmp_path / "m.pte"), "quiet": True, **given})


def test_the_plan_holds_what_every_stage_runs(tmp_path):
    from llmcore.pipeline import emit, lower
    from llmcore.pipeline.plan import resolve_plan

    plan = resolve_plan(_options(tmp_path, quantize="int8-dynamic"), load_registry())
    assert plan.family_name == "nanogpt" and plan.loader is None and plan.config == "tiny"
    assert plan.backend_names == ("xnnpack",) and plan.backends[0][1]["share_tied_weights"] is True
    assert plan.recipe.record.name == "int8-dynamic" and plan.recipe_options == {"per_channel": True}
    assert plan.checkpoint_recipe is None and not plan.keeps_integers
    assert [t.record.name for t in plan.transforms][-1] == "kv-cache"
    assert [p.record.name for p in plan.post_passes] == ["convert-to-linear"]
    assert set(lower.LOWERING_PATCHES) | set(emit.EMIT_PATCHES) <= set(plan.patches)
    assert {"remembered_passes", "source_partitions_found_once", "ops_kept_without_filter"} <= set(plan.patches)
    assert plan.runs_on == {"XnnpackBackend": plan.backends[0][0].record.runs_on}

    unquantized = resolve_plan(_options(tmp_path), load_registry())
    assert unquantized.recipe is None and unquantized.keeps_integers
    assert unquantized.checkpoint_recipe is not None  # what a quantized GGUF would get, chosen now


def test_the_stages_look_nothing_up_after_planning(tmp_path, monkeypatch):
    """After the plan is made, the registry is sealed: the export still runs to the end."""
    import llmcore.pipeline as pipeline

    class Sealed:
        sealed = False

        def __init__(self, registry):
            self._registry = registry

        def __getattr__(self, name):
            if Sealed.sealed:
                raise AssertionError(f"a stage used registry.{name} after planning")
            return getattr(self._registry, name)

    planned = pipeline.plan_export

    def plan_then_seal(options, registry):
        plan = planned(options, registry)
        Sealed.sealed = True
        return plan

    monkeypatch.setattr(pipeline, "plan_export", plan_then_seal)
    result = pipeline.export(_options(tmp_path, max_seq_len=32), Sealed(load_registry()))
    assert Sealed.sealed and result.pte.exists() and result.report["parity"]["top1_agreement"] == 1.0


def test_an_executorch_outside_a_patch_range_stops_before_loading(tmp_path, monkeypatch):
    import llmcore.pipeline as pipeline

    installed = upstream.installed_version
    monkeypatch.setattr(upstream, "installed_version", lambda p: "1.6.0" if p == "executorch" else installed(p))
    monkeypatch.setattr(pipeline, "load_model", lambda plan: pytest.fail("the model was loaded"))
    with pytest.raises(upstream.UpstreamPatchError) as raised:
        llmcore.export(_options(tmp_path))
    line = str(raised.value)
    assert raised.value.stage == "plan" and "\n" not in line
    assert "upstream patch 'lean_dependency_viewers'" in line and "executorch 1.6.0 is installed" in line
    assert f"{upstream.SWITCH}=lean_dependency_viewers" in line
    assert not list(tmp_path.iterdir())

    monkeypatch.setenv(upstream.SWITCH, "all")  # switched off: nothing to check
    assert llmcore.export_steps(_options(tmp_path)).plan.patches


def test_a_backends_patches_are_checked_too(tmp_path, monkeypatch):
    from llmcore.pipeline.plan import plan_export

    monkeypatch.setenv(upstream.SWITCH, ",".join(p for p in upstream.PATCHES if upstream.PATCHES[p].module ==
                                                 upstream.__name__))
    installed = upstream.installed_version
    monkeypatch.setattr(upstream, "installed_version", lambda p: "1.3.0" if p == "executorch" else installed(p))
    with pytest.raises(upstream.UpstreamPatchError) as raised:
        plan_export(_options(tmp_path), load_registry())
    assert "llmcore_xnnpack/lowering.py" in str(raised.value)


def test_the_architecture_catalogue_is_data_naming_real_plugins():
    from llmcore.pipeline.load import architecture_catalogue

    catalogue = architecture_catalogue()
    assert catalogue["qwen3"] == "llmcore-qwen" and catalogue["gpt2"] == "llmcore-nanogpt"
    names = {re.search(r'^name = "(.+)"', p.read_text(), re.M).group(1)
             for p in ROOT.glob("plugins/*/pyproject.toml")}
    assert set(catalogue.values()) <= names
    core = [p for p in (ROOT / "llmcore").rglob("*.py") if "llmcore-qwen" in p.read_text()]
    assert core == []  # no family plugin named in the core's code


def test_a_name_error_is_still_one_line_before_loading(tmp_path):
    with pytest.raises(LlmcoreError) as raised:
        llmcore.export_steps(_options(tmp_path, quantize="8da4w", plugins=["none"]))
    assert str(raised.value).startswith("[quantize/xnnpack] quantizer recipe '8da4w' is meant for xnnpack")
