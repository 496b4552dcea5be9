"""``--chat-template``: a chat template for a model whose checkpoint has none (nanoGPT, a
base model), given to ``serve``, ``chat`` and ``run --chat``, or recorded by ``export``.

The program is the tiny nanoGPT (random weights, byte-level tokenizer), exported without a
template. Authorities: the ``openai`` client for the protocol; ChatML written out by hand
here and a freshly loaded program's greedy tokens (``servetools.reference``) for the text.
Bad names and files are in the bad-input matrix (tests/test_bad_inputs.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from servetools import reference, serve_program

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about llamas"}]
CHATML = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell me about llamas<|im_end|>\n"
          "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def plain(exports):
    """The tiny program, exported without a chat template."""
    pte = exports("xnnpack").pte
    assert json.loads(pte.with_name("tokenizer_config.json").read_text())["chat_template"] is None
    return pte


def ask(base: str):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)


def test_serve_takes_a_builtin_template_for_a_model_without_one(plain, tmp_path):
    (tmp_path / "without").mkdir()
    with serve_program(plain, tmp_path / "without", None) as (base, _):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(base)
        assert refused.value.body["param"] == "messages" and "--chat-template" in refused.value.body["message"]
    (tmp_path / "with").mkdir()
    with serve_program(plain, tmp_path / "with", None, args=["--chat-template", "chatml"]) as (base, pte):
        assert ask(base).choices[0].message.content == reference(pte, CHATML, 8)


def test_export_records_the_template_and_serve_uses_it_unasked(exports, tmp_path):
    from llmcore.runtime.chat_template import BUILTIN_TEMPLATES

    result = exports("chatml")
    saved = json.loads(result.pte.with_name("tokenizer_config.json").read_text())
    assert saved["chat_template"] == BUILTIN_TEMPLATES["chatml"]
    assert result.report["model"]["metadata"]["chat_template"] is True
    with serve_program(result.pte, tmp_path, None) as (base, pte):
        assert ask(base).choices[0].message.content == reference(pte, CHATML, 8)


def test_run_chat_with_a_template_file(plain, cli, tmp_path):
    from llmcore.runtime.generate import TextTokenizer

    template = tmp_path / "turns.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    run = cli("run", str(plain), "--chat", "--chat-template", str(template), "--prompt", "hi",
              "--max-new-tokens", "4", "--json")
    assert run.returncode == 0, run.stderr
    expected = TextTokenizer.from_file(plain.with_name("tokenizer.json")).encode("user: hi\nassistant:")
    assert json.loads(run.stdout)["prompt_ids"] == expected
    refused = cli("run", str(plain), "--chat", "--prompt", "hi")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "has no chat template" in refused.stderr and "--chat-template" in refused.stderr


def test_chat_in_the_terminal_takes_a_builtin_template(plain):
    def chat(*flags):
        return subprocess.run([sys.executable, "-m", "llmcore", "chat", str(plain), "--max-new-tokens", "4", *flags],
                              input="hello\n/exit\n", capture_output=True, text=True, timeout=300)

    out = chat("--chat-template", "zephyr")
    assert out.returncode == 0, out.stderr
    assert any(line.startswith("[prompt ") for line in out.stderr.splitlines())
    refused = chat()
    assert refused.returncode == 2 and "--chat-template" in refused.stderr.splitlines()[-1]


@pytest.mark.parametrize("name", ["chatml", "llama3", "zephyr"])
def test_builtin_templates_write_their_formats(name):
    """Each built-in, against its format written out by hand."""
    from llmcore.runtime.chat_template import BUILTIN_TEMPLATES, ChatTemplate

    expected = {
        "chatml": CHATML,
        "llama3": "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nTell me about llamas<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "zephyr": "<|system|>\nBe brief.</s>\n<|user|>\nTell me about llamas</s>\n<|assistant|>\n",
    }
    assert ChatTemplate(BUILTIN_TEMPLATES[name], eos_token="</s>").render(MESSAGES) == expected[name]


def test_a_builtin_format_ends_a_reply_at_its_turn_end_even_as_plain_text():
    """A base model given ChatML has ``<|im_end|>`` as plain text, not as its EOS token: the
    reply stops at the text (serve and chat take it as a stop string), as it would at EOS in
    a model trained on the format. A template of the model's own adds none: its EOS ids end it."""
    from llmcore.runtime.chat_template import BUILTIN_TEMPLATES, ChatTemplate

    assert ChatTemplate(BUILTIN_TEMPLATES["chatml"]).stop_strings == ["<|im_end|>"]
    assert ChatTemplate(BUILTIN_TEMPLATES["llama3"]).stop_strings == ["<|eot_id|>"]
    assert ChatTemplate(BUILTIN_TEMPLATES["zephyr"]).stop_strings == []  # its turn ends with the EOS token
    assert ChatTemplate("{{ messages[0]['content'] }}").stop_strings == []

