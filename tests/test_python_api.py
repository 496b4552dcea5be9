"""llmcore's Python API against its command line: the same program byte for byte from the
one call, from the stages run one by one, and from ``llmcore export``; partitioner objects
passed in are the ones used; ``load().generate()`` gives ``llmcore run --json``'s ids."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import llmcore
from clitools import read_json, run_cli
from llmcore.errors import LlmcoreError

OPTIONS = dict(model="nanogpt", config="tiny", plugins=["xnnpack"], quantize="int8-dynamic")
FLAGS = ["--model", "nanogpt", "--config", "tiny", "--plugins", "xnnpack", "--quantize", "int8-dynamic"]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """The same export three ways: ``llmcore export``, ``llmcore.export()``, and every stage
    of ``llmcore.export_steps()`` called in turn with nothing changed."""
    folder = tmp_path_factory.mktemp("api")
    paths = {}
    for way in ("cli", "call", "steps"):
        (folder / way).mkdir()
        paths[way] = folder / way / "tiny.pte"
    done = run_cli("export", *FLAGS, "-o", str(paths["cli"]), "--quiet")
    assert done.returncode == 0, done.stderr
    call = llmcore.export(**OPTIONS, output=str(paths["call"]), quiet=True)
    steps = llmcore.export_steps(**OPTIONS, output=str(paths["steps"]), quiet=True)
    staged = steps.load().transform().capture().quantize().lower().post_passes().to_executorch().save()
    assert call.pte == paths["call"] and staged.pte == paths["steps"]
    return paths


def test_the_one_call_and_the_steps_write_the_clis_program(programs):
    cli = programs["cli"].read_bytes()
    assert programs["call"].read_bytes() == cli
    assert programs["steps"].read_bytes() == cli
    reports = {way: read_json(path.with_name("tiny.report.json")) for way, path in programs.items()}
    for report in reports.values():
        for varies in ("stages", "outputs"):
            report.pop(varies)
        report["options"].pop("output")
    assert reports["call"] == reports["cli"] and reports["steps"] == reports["cli"]


def test_load_generate_gives_the_ids_of_llmcore_run(programs):
    pte = programs["call"]
    run = run_cli("run", str(pte), "--prompt", PROMPT, "--max-new-tokens", "12", "--json")
    assert run.returncode == 0, run.stderr
    expected = json.loads(run.stdout)
    reply = llmcore.load(pte).generate(PROMPT, 12)
    assert reply.prompt_ids == expected["prompt_ids"] and reply.generated_ids == expected["generated_ids"]
    assert reply.text == expected["text"]


def test_a_partitioner_passed_in_is_the_one_used(tmp_path, exports):
    """XNNPACK given the linear layers only: its delegates hold nothing else, where the
    backend's own partitioner (the same options otherwise) takes the whole layers."""
    from executorch.backends.xnnpack.partition.config.gemm_configs import LinearConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    steps = llmcore.export_steps(model="nanogpt", config="tiny", plugins=["xnnpack"], output=str(tmp_path / "l.pte"),
                                 quiet=True)
    result = steps.lower([XnnpackPartitioner(configs=[LinearConfig])]).save()
    ours = result.report["delegation"]["by_backend"]["XnnpackBackend"]["operators"]
    own = exports("xnnpack").report["delegation"]["by_backend"]["XnnpackBackend"]["operators"]
    assert set(ours) == {"aten_linear_default"} and set(own) > {"aten_linear_default"}
    assert result.report["delegation"]["non_delegated_nodes"] > exports("xnnpack").report["delegation"]["non_delegated_nodes"]
    assert result.report["partitioners"] == ["XnnpackPartitioner"] and "partitioners" not in exports("xnnpack").report
    assert result.report["parity"]["top1_agreement"] == 1.0


def test_steps_run_in_order_once_and_a_passed_quantizer_needs_no_recipe(tmp_path):
    steps = llmcore.export_steps(**OPTIONS, output=str(tmp_path / "m.pte"), quiet=True)
    steps.load()
    with pytest.raises(LlmcoreError, match="load step has run already"):
        steps.load()
    with pytest.raises(LlmcoreError, match="quantizes with recipe 'int8-dynamic' already"):
        steps.quantize(lambda module: module)
    assert not list(tmp_path.iterdir())


def test_the_keywords_are_checked_like_a_recipe(tmp_path):
    with pytest.raises(LlmcoreError, match="unknown key 'modle'"):
        llmcore.export(modle="nanogpt", output=str(tmp_path / "m.pte"))
    with pytest.raises(LlmcoreError, match="'max_seq_len' must be an integer"):
        llmcore.export_options(model="nanogpt", output="m.pte", max_seq_len="long")
    with pytest.raises(TypeError):
        llmcore.export(llmcore.ExportOptions(model="nanogpt", output="m.pte"), quantize="none")
    options = llmcore.export_options(model="nanogpt", config="tiny", plugins="xnnpack,vulkan", output="m.pte", quiet=1)
    assert options.plugins == ["xnnpack", "vulkan"] and options.quiet is True


def test_importing_llmcore_imports_no_torch():
    code = ("import sys, llmcore\nassert set(llmcore.__all__) >= {'export', 'export_steps', 'load'}\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'executorch', 'torchao'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
