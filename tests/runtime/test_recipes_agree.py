"""The C++ runner gives Python's greedy answer on every XNNPACK recipe the project ships, in
each of its load modes and each instruction-set view this machine can present.

Issue 58: on an AVX2-only EPYC (and, it turned out, natively on an AVX-512 Zen 4),
``llmcore_runner`` printed blank lines for ``make demo``'s program and exited 0. Its loader
gave back the pages of a buffer the runtime had freed (MADV_DONTNEED: zeros in anonymous
memory), and the runtime loaded the same bytes again for the next delegate: RoPE's
pair-swap matrix is one named weight shared by every layer, and the second layer packed
zeros. Nothing caught it: the agreement tests ran programs whose heads were 16 wide, whose
matrix (1 KiB) is smaller than a page and so was never given back.

So the model here is shaped to reach that path: a random Llama with 64-wide heads (a 16 KiB
matrix, whole pages) and two layers (two delegates loading it). Its output layer is scaled
up so that its choices are clear (a random model's top logits are otherwise within a near
tie of each other), and a runner that computes something else picks tokens Python scores
far below its own (:func:`llmcore.runtime.agreement.follow` checks every token of the runner's).
On the loader before the fix this test fails for ``gguf``, ``8da4w``, ``8da8w`` and
``int8-dynamic`` in the default and trap loads, in every view (checked on the Zen 4 EPYC).

Each view (``llmcore/testing/isa_view.py``: native, and where the CPU has more, avx2 and
sse4) runs the Python runtime and the runner in one process tree with XNNPACK's and
llmcore's kernels capped to that instruction set, so an AVX-512 machine also runs the code
an AVX2-only or a pre-AVX x86 takes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmcore.runtime.agreement import LOAD_MODES
from llmcore.testing import isa_view
from test_runner import RUNNER, binaries  # noqa: F401  (the fixture builds the runner)

# recipe -> the checkpoint it exports from: the GGUF's own integers, or float weights
RECIPES = {"gguf": "gguf", "gguf-layers": "gguf", "8da4w": "hf", "8da8w": "hf", "int8-dynamic": "hf",
           "8da4w-layers": "hf", "8da8w-layers": "hf"}
PROMPT = "1 2 3 4 5 6"
STEPS = 24


@pytest.fixture(scope="module")
def recipe_programs(tmp_path_factory) -> dict[str, Path]:
    """recipe -> its program, exported from a random Llama with 64-wide heads (HF folder for
    the float recipes, a Q4_1 GGUF of it for the gguf ones)."""
    pytest.importorskip("transformers")
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file, save_file

    from llmcore.pipeline import export
    from llmcore.recipe import ExportOptions
    from llmcore_llama.testing import GGUF_LAYER_MATRICES, save_random_hf, write_gguf

    root = tmp_path_factory.mktemp("recipes-agree")
    hf = save_random_hf(root / "hf", "Llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=256, num_hidden_layers=2, max_position_embeddings=128)
    weights = next(hf.glob("*.safetensors"))
    state = load_file(str(weights))
    state["lm_head.weight"] = state["lm_head.weight"] * 6  # clear greedy choices (see the module)
    save_file(state, str(weights), metadata={"format": "pt"})
    gguf = root / "q4_1.gguf"
    write_gguf(hf, gguf, quantize={**{m: Q.Q4_1 for m in GGUF_LAYER_MATRICES}, "output.weight": Q.Q8_0})
    programs = {}
    for recipe, source in RECIPES.items():
        out = root / recipe / "model.pte"
        out.parent.mkdir()
        export(ExportOptions(model="llama", checkpoint=str(hf if source == "hf" else gguf),
                             tokenizer=str(hf / "tokenizer.json"), plugins=["xnnpack"], quantize=recipe,
                             max_seq_len=128, output=str(out), quiet=True))
        programs[recipe] = out
    return programs


def agreements(view: str, programs: dict[str, Path], runner: Path = RUNNER) -> list[dict]:
    """``python -m llmcore.runtime.agreement`` on every program under ``view``: one record per
    program and load mode."""
    command = [sys.executable, "-m", "llmcore.runtime.agreement", *map(str, programs.values()), "--runner", str(runner),
               "--prompt", PROMPT, "--max-new-tokens", str(STEPS), "--modes", ",".join(LOAD_MODES), "--json"]
    done = isa_view.run_in_view(view, command, capture_output=True, text=True, timeout=900)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert records, done.stderr[-2000:]
    return records


@pytest.mark.parametrize("view", isa_view.presentable_views())
def test_runner_gives_pythons_answer_on_every_recipe_and_load(binaries, recipe_programs, view):  # noqa: F811
    if view != "native" and shutil.which("cc") is None:
        pytest.skip("no C compiler for the ISA view's preload library")
    records = agreements(view, recipe_programs)
    recipe_of = {str(path): recipe for recipe, path in recipe_programs.items()}
    assert {(recipe_of[r["program"]], r["mode"]) for r in records} == {
        (recipe, f"llmcore_runner ({mode} load)") for recipe in RECIPES for mode in LOAD_MODES}
    wrong = [f"{recipe_of[r['program']]}: {r['line']}" for r in records if not r["agrees"]]
    assert not wrong, "\n".join(wrong)
    assert all(r["checked"] > 0 for r in records), records


def test_runner_gives_back_freed_weights_and_reads_them_again_when_reloaded(binaries, recipe_programs):  # noqa: F811
    """The gguf program's delegates free their blobs and the packed named weights (given
    back), and the second layer loads the shared pair-swap matrix again (read back)."""
    done = subprocess.run([str(RUNNER), str(recipe_programs["gguf"]), "--prompt", PROMPT, "--max-new-tokens", "2",
                           "--verbose"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    line = next(l for l in done.stderr.splitlines() if "given back after the runtime freed them" in l)
    given, read = _mib_figures(line)
    assert given > 0 and read > 0, line


def _mib_figures(line: str) -> tuple[float, float]:
    """(given back, read back) from the runner's --verbose line."""
    import re

    given, read = (int(x) for x in re.findall(r"([0-9]+) KiB", line))
    return given, read
