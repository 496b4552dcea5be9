"""Chat templates: turn a user message into the prompt an instruct model was trained on.

The template comes from the checkpoint (a GGUF's ``tokenizer.chat_template``, say) and is
saved by ``llmcore export`` in ``tokenizer_config.json`` next to ``tokenizer.json``, the
way Hugging Face keeps it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from llmcore.errors import LlmcoreError

CONFIG_FILE = "tokenizer_config.json"


def tokenizer_config(chat_template: Optional[str], bos_token: Optional[str], eos_token: Optional[str]) -> str:
    return json.dumps(
        {"chat_template": chat_template, "bos_token": bos_token, "eos_token": eos_token}, indent=2
    ) + "\n"


def apply_template(tokenizer_path: str | Path, user_message: str) -> str:
    config_path = Path(tokenizer_path).with_name(CONFIG_FILE)
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        config = {}
    template = config.get("chat_template")
    if not template:
        raise LlmcoreError(
            "this model has no chat template.",
            stage="run",
            fix=f"drop --chat, or export from a checkpoint that carries one ({config_path.name} next to the tokenizer).",
        )
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(template).render(
            messages=[{"role": "user", "content": user_message}],
            add_generation_prompt=True,
            bos_token=config.get("bos_token") or "",
            eos_token=config.get("eos_token") or "",
        )
    except Exception as exc:
        raise LlmcoreError(
            f"the model's chat template failed to render: {exc}",
            stage="run",
            fix="drop --chat and write the prompt in the model's format yourself.",
        ) from None
