"""Does the C++ runner answer as the Python runtime does, for one program and prompt?

A runner that prints the wrong tokens and exits 0 is the worst failure this project can
have (issue 58: ``llmcore_runner`` answered blank lines where ``llmcore run`` answered
"Paris", and nothing failed). Everything that shows or times the C++ runner checks its
tokens with this module: ``make demo``, the benchmarks and the tests.

The check follows the runner's own tokens: the Python runtime reads the same prompt, and
at each step it computes the next-token logits for the prefix the runner had, and the
runner's token there must be Python's greedy choice, or within :data:`NEAR_TIE` logits of
it. The two runtimes are separate builds of ExecuTorch's kernels (the wheel's Python
extension and its C++ libraries) and may round a last bit differently; with dynamically
quantized activations that can pick the other of two tokens whose logits are that close,
and from there the two texts part. Following the runner's path instead of comparing two
independent generations keeps checking after such a tie, so a check never passes because
it compared nothing. A broken runtime fails where the answer is clear: in issue 58 the
runner's first token scored 0.92 logits or more below Python's choice, and later ones
several logits below.

    python -m llmcore.runtime.agreement PROGRAM.pte --runner build/llmcore_runner --prompt-file F

prints the runner's text (with ``--show-text``) and one line saying what was checked; it
exits 1 with one line saying where the runner went wrong.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from llmcore.errors import LlmcoreError

NEAR_TIE = 0.5
"""How far (in logits) below Python's greedy choice the runner's token may score: twice the
largest gap at which the runner and Python were seen to part (on SmolLM2's 8da4w program,
tests/test_real_smollm2.py; docs/performance.md, "Checked tokens")."""

LOAD_MODES = {
    # how llmcore_runner holds the program: its flags and environment
    "default": ((), {}),  # read into huge pages; freed segments given back
    "mmap": (("--mmap",), {}),  # the file mapped
    # freed segments made inaccessible: a read of one stops the runner (mmap_data_loader.h)
    "trap": ((), {"LLMCORE_RUNNER_TRAP_RELEASED": "1"}),
}


@dataclass
class RunnerRun:
    """What the runner printed: its generated ids, its text (before the ids line) and its
    ``stats:`` line (key -> text)."""

    ids: list[int]
    text: str = ""
    stats: dict = field(default_factory=dict)
    command: list[str] = field(default_factory=list)


@dataclass
class Agreement:
    """The runner's tokens scored by Python on the runner's own path. ``best``: Python's
    greedy choice at each step; ``gaps``: how far below it the runner's token scored (0 where
    they are the same)."""

    runner: RunnerRun
    prompt_tokens: int  # the prompt as Python's tokenizer reads it (BOS included)
    best: list[int]
    gaps: list[float]
    near_tie: float = NEAR_TIE
    label: str = "llmcore_runner"

    @property
    def first_wrong(self) -> Optional[int]:
        return next((i for i, gap in enumerate(self.gaps) if gap > self.near_tie), None)

    @property
    def prompt_differs(self) -> bool:
        counted = self.runner.stats.get("prompt_tokens")
        return counted is not None and int(counted) != self.prompt_tokens

    @property
    def agrees(self) -> bool:
        return not self.prompt_differs and self.first_wrong is None

    @property
    def ties(self) -> int:
        """Steps where the runner took another token than Python, within a near tie."""
        return sum(1 for gap in self.gaps if 0 < gap <= self.near_tie)

    def line(self) -> str:
        if self.prompt_differs:
            return (f"{self.label}: the prompt is {self.runner.stats['prompt_tokens']} tokens to the runner and "
                    f"{self.prompt_tokens} to Python: the two tokenizers disagree")
        wrong = self.first_wrong
        if wrong is not None:
            return (f"{self.label}: its token at step {wrong} of {len(self.gaps)} ({self.runner.ids[wrong]}) scores "
                    f"{self.gaps[wrong]:.3g} logits below Python's choice there ({self.best[wrong]}), more than a "
                    f"near tie ({self.near_tie})")
        ties = f", {self.ties} of them another token within a near tie" if self.ties else ""
        return f"{self.label}: each of its {len(self.gaps)} tokens is Python's choice{ties}"

    def error(self) -> LlmcoreError:
        return LlmcoreError(
            self.line() + ".", stage="runner",
            fix="run the runner with --mmap and with LLMCORE_RUNNER_TRAP_RELEASED=1 to see whether its loader is "
            "at fault, and report the CPU (lscpu) with the program's report.json.")


def follow(pte: str | Path, prompt: str, runner: RunnerRun, *, label: str = "llmcore_runner",
           near_tie: float = NEAR_TIE) -> Agreement:
    """Python on the runner's path: the prompt as ``llmcore run`` reads it (the tokenizer next
    to the program, BOS as the program asks), then the runner's tokens one by one, each
    scored against the logits Python computed for the prefix before it. Fed as the runner
    feeds them: the prompt in calls of at most ``max_seq_len`` tokens, then one per call
    (a program without a KV cache gets its last ``max_seq_len`` tokens each time)."""
    import torch

    from llmcore.runtime.generate import TextTokenizer, prompt_ids_for, tokenizer_beside
    from llmcore.runtime.program import Program

    program = Program.load(pte)
    tokens = prompt_ids_for(program, TextTokenizer.from_file(tokenizer_beside(pte)), prompt)
    prompt_tokens = len(tokens)
    best, gaps = [], []

    def next_logits() -> torch.Tensor:
        if program.use_kv_cache:
            return program.logits(tokens[fed:], fed).float().reshape(-1)
        return program.logits(tokens[-program.max_seq_len:], None).float().reshape(-1)

    fed = 0
    for step, token in enumerate(runner.ids):
        logits = next_logits()
        fed = len(tokens)
        top = int(torch.argmax(logits))  # the lowest id on a tie, as the runner's sampler
        best.append(top)
        gaps.append(0.0 if token == top else float(logits[top] - logits[token]))
        tokens.append(token)
    return Agreement(runner, prompt_tokens, best, gaps, near_tie=near_tie, label=label)


def run_runner(runner: str | Path, pte: str | Path, prompt: str, max_new_tokens: int, *, mode: str = "default",
               extra_args: Sequence[str] = (), env: Optional[dict] = None, timeout: float = 600) -> RunnerRun:
    """``llmcore_runner PTE --prompt-file ... --print-ids --temperature 0`` in a load mode of
    :data:`LOAD_MODES`; the prompt goes through a file so that it arrives byte for byte."""
    import tempfile

    flags, mode_env = LOAD_MODES[mode]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as f:
        f.write(prompt)
    try:
        command = [str(runner), str(pte), "--prompt-file", f.name, "--max-new-tokens", str(max_new_tokens),
                   "--temperature", "0", "--print-ids", *flags, *extra_args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=dict(env if env is not None else os.environ) | mode_env)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise LlmcoreError(f"llmcore_runner failed on {pte} ({mode} load, exit {done.returncode}): {last}",
                           stage="runner", fix="run the command by hand: " + " ".join(command))
    return parse_runner_output(done.stdout, done.stderr, command)


def parse_runner_output(stdout: str, stderr: str, command: Sequence[str] = ()) -> RunnerRun:
    """The ids, text and stats of a ``--print-ids`` run of the runner."""
    lines = stdout.splitlines()
    at = max((i for i, line in enumerate(lines) if line.startswith("ids:")), default=None)
    if at is None:
        raise LlmcoreError("llmcore_runner printed no 'ids:' line.", stage="runner",
                           fix="pass --print-ids (a runner older than the flag cannot be checked).")
    stats = next((dict(item.split("=", 1) for item in line.split()[1:] if "=" in item)
                  for line in reversed(stderr.splitlines()) if line.startswith("stats:")), {})
    return RunnerRun([int(i) for i in lines[at].split()[1:]], "\n".join(lines[:at]), stats, list(command))


def check(pte: str | Path, runner: str | Path, prompt: str, max_new_tokens: int, *,
          modes: Sequence[str] = ("default",)) -> list[Agreement]:
    """The runner, in each load mode, followed by Python on the same prompt."""
    return [follow(pte, prompt, run_runner(runner, pte, prompt, max_new_tokens, mode=mode),
                   label=f"llmcore_runner ({mode} load)") for mode in modes]


def main(argv: Optional[Sequence[str]] = None) -> int:
    import json

    parser = argparse.ArgumentParser(prog="python -m llmcore.runtime.agreement", description=__doc__.splitlines()[0])
    parser.add_argument("programs", nargs="+", help=".pte files (each with its tokenizer.json beside it)")
    parser.add_argument("--runner", required=True, help="the llmcore_runner to check")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt")
    source.add_argument("--prompt-file", help="the prompt, byte for byte")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--modes", default="default", help=f"load modes, comma-separated: {', '.join(LOAD_MODES)}")
    parser.add_argument("--show-text", action="store_true", help="print the runner's text (the first run's)")
    parser.add_argument("--json", action="store_true", help="one JSON object per program and mode on stdout")
    args = parser.parse_args(argv)
    prompt = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text(encoding="utf-8")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in LOAD_MODES]
    if unknown:
        parser.error(f"unknown load mode {unknown[0]!r}; choose from {', '.join(LOAD_MODES)}")
    failed = False
    try:
        for pte in args.programs:
            for agreement in check(pte, args.runner, prompt, args.max_new_tokens, modes=modes):
                if args.show_text:
                    print(agreement.runner.text, flush=True)
                    args.show_text = False
                if args.json:
                    print(json.dumps({"program": str(pte), "mode": agreement.label, "agrees": agreement.agrees,
                                      "line": agreement.line(), "checked": len(agreement.gaps),
                                      "ties": agreement.ties, "runner": agreement.runner.ids,
                                      "text": agreement.runner.text,
                                      "python": agreement.best}), flush=True)
                elif agreement.agrees:
                    print(f"agreement: {agreement.line()}.", flush=True)
                else:
                    print(f"llmcore: error: {agreement.error().one_line()}", file=sys.stderr, flush=True)
                failed |= not agreement.agrees
    except LlmcoreError as exc:
        print(f"llmcore: error: {exc.one_line()}", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
