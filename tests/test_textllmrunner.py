"""ExecuTorch's own TextLLMRunner generates from an llmcore program, as llmcore run does."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import sys
import executorch.extension.llm.custom_ops.custom_ops  # the program's KV-cache ops
from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

runner = TextLLMRunner(sys.argv[1], sys.argv[2])
pieces = []
config = GenerationConfig(max_new_tokens=12, temperature=0.0, echo=False)
runner.generate("Hello", config, token_callback=pieces.append)
print("TEXT:" + repr("".join(pieces)))
"""


def test_text_llm_runner_matches_llmcore_run(exports, cli):
    pte = exports("xnnpack").pte
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(pte), str(pte.with_name("tokenizer.json"))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = eval(next(l for l in out.stdout.splitlines() if l.startswith("TEXT:"))[5:])
    ours = json.loads(cli("run", str(pte), "--prompt", "Hello", "--max-new-tokens", "12", "--json").stdout)
    assert text == ours["text"] and len(text) > 0


def test_run_refuses_a_tokenizer_of_another_model(exports, cli, tmp_path):
    big = tmp_path / "tokenizer.json"
    from llmcore_nanogpt.tokenizer import bytes_to_unicode, tokenizer_json

    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)} | {f"tok{i}": 256 + i for i in range(100)}
    big.write_text(tokenizer_json(vocab, []))
    result = cli("run", str(exports("xnnpack").pte), "--prompt", "hi", "--tokenizer", str(big))
    assert result.returncode == 2 and "belongs to another model" in result.stderr
