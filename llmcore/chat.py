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


class ChatTemplate:
    """A model's chat template, compiled once: ``render(messages)`` gives the prompt text.

    Rendered in Jinja's immutable sandbox, as transformers' ``apply_chat_template`` does: the
    template comes with the checkpoint and must not reach Python objects beyond its inputs."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template)
        self.source = template
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def beside(cls, tokenizer_path: str | Path) -> Optional["ChatTemplate"]:
        """The template saved next to ``tokenizer_path`` by ``llmcore export``, or None."""
        config_path = Path(tokenizer_path).with_name(CONFIG_FILE)
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError):
            config = {}
        template = config.get("chat_template")
        if not template:
            return None
        return cls(template, config.get("bos_token") or "", config.get("eos_token") or "")

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


def apply_template(tokenizer_path: str | Path, user_message: str) -> str:
    template = ChatTemplate.beside(tokenizer_path)
    if template is None:
        raise LlmcoreError(
            "this model has no chat template.",
            stage="run",
            fix=f"drop --chat, or export from a checkpoint that carries one ({CONFIG_FILE} next to the tokenizer).",
        )
    return template.render([{"role": "user", "content": user_message}])


# ---- llmcore chat: a conversation in the terminal -----------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="a multi-turn chat with a .pte program in the terminal")
    p.add_argument("pte")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the one next to the .pte)")
    p.add_argument("--system", help="a system message to start the conversation with")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    """Read a line, answer it with the whole conversation as the prompt, repeat. The program's
    KV cache keeps the conversation so far (llmcore.serve.Engine), so each turn prefills only
    its new tokens; the line after each reply says how many came from the cache."""
    import sys
    import threading
    import time

    from llmcore.generate import Sampling, prompt_ids_for, tokenizer_beside
    from llmcore.serve import Engine, Request, run

    if args.max_new_tokens < 1:
        raise LlmcoreError("--max-new-tokens must be at least 1.", stage="chat",
                           fix="pass a positive --max-new-tokens.")
    Sampling(temperature=args.temperature, top_p=args.top_p)  # refuses bad values before loading
    tokenizer_path = args.tokenizer or tokenizer_beside(args.pte)
    template = ChatTemplate.beside(tokenizer_path)
    if template is None:
        raise LlmcoreError("this model has no chat template.", stage="chat",
                           fix="use `llmcore run --prompt` with the prompt in the model's own format.")
    engine = Engine(args.pte, str(tokenizer_path))
    context = engine.program.max_context_len
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    print(f"chat with {Path(args.pte).name} ({context} positions): /reset starts over, /exit or Ctrl-D leaves",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            history = list(start)
            print("(a new conversation)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        messages = history + [{"role": "user", "content": line}]
        ids = prompt_ids_for(engine.program, engine.tokenizer, template.render(messages))
        if len(ids) >= context:
            print(f"(the conversation is {len(ids)} tokens, more than the program's {context}: /reset to go on)",
                  file=sys.stderr)
            continue
        request = Request(ids, min(args.max_new_tokens, context - len(ids)), args.temperature, args.top_p,
                          args.seed, [], False, False)
        began = time.perf_counter()
        try:
            outcome = run(engine, request, lambda text: (sys.stdout.write(text), sys.stdout.flush()),
                          threading.Event())
        except KeyboardInterrupt:
            print("\n(interrupted; the reply is not kept)", file=sys.stderr)
            continue
        seconds = time.perf_counter() - began
        print()
        print(f"[prompt {outcome.prompt_tokens} tokens, {outcome.cached_tokens} from the cache | "
              f"{outcome.completion_tokens} tokens in {seconds:.2f} s, "
              f"{outcome.completion_tokens / max(seconds, 1e-9):.1f} tok/s | {outcome.finish_reason}]", file=sys.stderr)
        history = messages + [{"role": "assistant", "content": outcome.text}]
