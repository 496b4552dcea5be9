"""Chat templates: turn a user message into the prompt an instruct model was trained on.

The template comes from the checkpoint (a GGUF's ``tokenizer.chat_template``, say) and is
saved by ``llmcore export`` in ``tokenizer_config.json`` next to ``tokenizer.json``, the
way Hugging Face keeps it. A model without one (a base model, nanoGPT) can be given one
with ``--chat-template``: a Jinja file, or one of :data:`BUILTIN_TEMPLATES` by name, as
llama-server and vLLM take it. ``export`` records it in ``tokenizer_config.json``; ``serve``,
``chat`` and ``run --chat`` use it in place of the saved one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from llmcore import nesting
from llmcore.errors import LlmcoreError, describe, read_text_file

CONFIG_FILE = "tokenizer_config.json"

# The templates llmcore carries, for ``--chat-template NAME``. None writes ``bos_token``: a
# program's BOS comes from its metadata (llmcore.runtime.generate.prompt_ids_for), as for every prompt.
BUILTIN_TEMPLATES = {
    # ChatML (OpenAI's; Qwen, SmolLM2, Hermes fine-tunes)
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Llama 3's role headers
    "llama3": (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    # Zephyr's: a tag line per turn, each turn closed by the end-of-sequence token
    "zephyr": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
}
TEMPLATE_CHOICES = f"a built-in template ({', '.join(BUILTIN_TEMPLATES)}) or a Jinja file"
# The text each built-in closes an assistant turn with. A model trained on that format has
# it as a special token that is also its EOS; a base model given the format with
# --chat-template has it as plain text, so replies stop at the text too (serve, chat).
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}


def tokenizer_config(chat_template: Optional[str], bos_token: Optional[str], eos_token: Optional[str]) -> str:
    return json.dumps(
        {"chat_template": chat_template, "bos_token": bos_token, "eos_token": eos_token}, indent=2
    ) + "\n"


class ChatTemplate:
    """A model's chat template, compiled once: ``render(messages)`` gives the prompt text.

    Rendered in Jinja's immutable sandbox, as transformers' ``apply_chat_template`` does: the
    template comes with the checkpoint and must not reach Python objects beyond its inputs."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "", *,
                 origin: str = "the model's chat template"):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            self._template = env.from_string(template)
        except Exception as exc:  # a TemplateSyntaxError; a RecursionError past Python's nesting
            line = getattr(exc, "lineno", None)
            raise LlmcoreError(f"{origin} is not a Jinja template: {describe(exc)}"
                               + (f" (line {line})" if line else ""), stage="chat-template",
                               fix=f"correct the template, or pass --chat-template with {TEMPLATE_CHOICES}.") from None
        self.source = template
        self.bos_token, self.eos_token = bos_token, eos_token
        # a built-in's turn end (found by its text, so a template export recorded from one counts)
        name = next((n for n, t in BUILTIN_TEMPLATES.items() if t == template), None)
        self.end_of_turn: Optional[str] = END_OF_TURN.get(name) if name else None

    @property
    def stop_strings(self) -> list[str]:
        """Texts a reply ends at besides the program's EOS ids: the built-in format's turn end."""
        return [self.end_of_turn] if self.end_of_turn else []

    @property
    def tool_calls_tagged(self) -> bool:
        """Whether the template teaches ``<tool_call>...</tool_call>`` (Hermes, SmolLM2,
        Qwen2.5) rather than bare JSON calls (Llama 3.x)."""
        return "<tool_call>" in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: Optional[list] = None) -> str:
        extra = {"tools": tools} if tools else {}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **extra,
            )
        except Exception as exc:
            raise LlmcoreError(
                f"the model's chat template failed to render: {exc}",
                stage="run",
                fix="write the prompt in the model's format yourself (no --chat; /v1/completions when serving).",
            ) from None


def template_source(value: str) -> str:
    """The Jinja text ``--chat-template VALUE`` names: a built-in's, else the file's at that
    path (names first: a file called ``chatml`` is ``./chatml``). Compiled here, so that a
    bad template fails before a model is loaded."""
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    if not Path(value).exists():
        raise LlmcoreError(f"--chat-template {value!r} is neither a built-in template nor a file.", stage="cli",
                           fix=f"name {TEMPLATE_CHOICES}.")
    source = read_text_file(value, "--chat-template file", "cli", f"name {TEMPLATE_CHOICES}.")
    ChatTemplate(source, origin=f"--chat-template {value!r}")
    return source


def load_template(tokenizer_path: str | Path, option: Optional[str] = None) -> Optional[ChatTemplate]:
    """The template conversations are written with: ``--chat-template``'s when given
    (:func:`template_source`), else the one ``llmcore export`` saved next to
    ``tokenizer_path``; None when neither gives one. The BOS and EOS texts come from the
    saved config either way (Zephyr's format closes each turn with the EOS token)."""
    config_path = Path(tokenizer_path).with_name(CONFIG_FILE)
    try:
        config = nesting.loads(config_path.read_text(encoding="utf-8"), what=f"{CONFIG_FILE} {str(config_path)!r}",
                               stage="tokenizer", fix="export the model again, or delete that file.")
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    template = template_source(option) if option else config.get("chat_template")
    if not template:
        return None
    origin = f"--chat-template {option!r}" if option else f"the chat template in {str(config_path)!r}"
    return ChatTemplate(template, config.get("bos_token") or "", config.get("eos_token") or "", origin=origin)


def apply_template(tokenizer_path: str | Path, user_message: str, option: Optional[str] = None) -> str:
    """``run --chat``: one user message as the model's chat template writes it."""
    template = load_template(tokenizer_path, option)
    if template is None:
        raise LlmcoreError(
            "this model has no chat template.",
            stage="run",
            fix=f"pass --chat-template with {TEMPLATE_CHOICES}, drop --chat, or export from a checkpoint that "
            f"carries one ({CONFIG_FILE} next to the tokenizer).",
        )
    return template.render([{"role": "user", "content": user_message}])


def add_template_option(parser, what: str) -> None:
    """``--chat-template`` for ``export``, ``run``, ``chat`` and ``serve``; ``what`` it does there."""
    parser.add_argument("--chat-template", metavar="NAME|FILE",
                        help=f"{what}: {TEMPLATE_CHOICES}")
