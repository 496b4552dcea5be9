"""``llmcore chat``: a multi-turn conversation with a ``.pte`` program in the terminal.

Each turn is the whole conversation written with the model's chat template
(:mod:`llmcore.runtime.chat_template`); the program's KV cache keeps the conversation so far
(:class:`llmcore.runtime.session.Engine`, the engine ``llmcore serve`` runs too), so a turn
prefills only its new tokens.
"""

from __future__ import annotations

from pathlib import Path

from llmcore.errors import LlmcoreError
from llmcore.runtime.chat_template import TEMPLATE_CHOICES, add_template_option, load_template


def add_arguments(p) -> None:
    p.add_argument("pte")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the one next to the .pte)")
    p.add_argument("--system", help="a system message to start the conversation with")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    add_template_option(p, "the chat template, in place of the one saved with the program")


def cmd_chat(args) -> int:
    """Read a line, answer it with the whole conversation as the prompt, repeat. The program's
    KV cache keeps the conversation so far (llmcore.runtime.session.Engine), so each turn prefills only
    its new tokens; the line after each reply says how many came from the cache."""
    import sys
    import threading
    import time

    from llmcore.runtime.generate import Sampling, prompt_ids_for, tokenizer_beside
    from llmcore.runtime.session import Engine, Request, run

    if args.max_new_tokens < 1:
        raise LlmcoreError("--max-new-tokens must be at least 1.", stage="chat",
                           fix="pass a positive --max-new-tokens.")
    Sampling(temperature=args.temperature, top_p=args.top_p)  # refuses bad values before loading
    tokenizer_path = args.tokenizer or tokenizer_beside(args.pte)
    template = load_template(tokenizer_path, args.chat_template)
    if template is None:
        raise LlmcoreError("this model has no chat template.", stage="chat",
                           fix=f"pass --chat-template with {TEMPLATE_CHOICES}, or use `llmcore run --prompt` with "
                           "the prompt in the model's own format.")
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
                          args.seed, template.stop_strings)
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
