"""llmcore.runtime.agreement: the Python runtime follows the C++ runner's tokens and says whether
each is its own greedy choice (up to a near tie), and where the runner went wrong.

The authority is the Python runtime on the same program (``llmcore run``'s); a stand-in
runner (a shell script) prints the tokens under test.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmcore.runtime.agreement import NEAR_TIE, Agreement, RunnerRun, follow, parse_runner_output

PROMPT = "abc"


def greedy_ids(pte, steps: int) -> list[int]:
    """``llmcore run``'s greedy tokens, through the same generate loop."""
    from llmcore.runtime.generate import Sampling, TextTokenizer, generate, prompt_ids_for, tokenizer_beside
    from llmcore.runtime import Program

    program = Program.load(pte)
    ids = prompt_ids_for(program, TextTokenizer.from_file(tokenizer_beside(pte)), PROMPT)
    return generate(program, ids, steps, Sampling(), stop_at_eos=False).generated_ids


def test_the_runtimes_own_greedy_tokens_are_its_choices(exports):
    pte = exports("xnnpack").pte
    ids = greedy_ids(pte, 12)
    a = follow(pte, PROMPT, RunnerRun(ids))
    assert a.agrees and a.best == ids and a.gaps == [0.0] * 12
    assert a.line() == "llmcore_runner: each of its 12 tokens is Python's choice"


def test_a_token_python_scores_well_below_its_choice_is_wrong_wherever_it_comes(exports):
    """Issue 58's shape, at the first step and after agreeing steps; the check goes on past
    the prompt along the runner's own tokens, so it never compares nothing."""
    pte = exports("xnnpack").pte
    ids = greedy_ids(pte, 6)
    clean = follow(pte, PROMPT, RunnerRun(ids))
    for step in (0, 4):
        wrong = list(ids)
        wrong[step] = (ids[step] + 1) % 64
        a = follow(pte, PROMPT, RunnerRun(wrong))
        assert a.best[:step] == ids[:step] and a.best[step] == ids[step]
        if a.gaps[step] > NEAR_TIE:
            assert not a.agrees and a.first_wrong == step
            assert f"its token at step {step} of 6 ({wrong[step]}) scores" in a.line()
        else:  # the replaced token happened to be within a near tie: allowed, and counted
            assert a.agrees and a.ties >= 1
    assert clean.agrees


def test_near_ties_are_allowed_and_a_tokenizer_mismatch_is_not():
    run = RunnerRun([7, 8, 9], stats={"prompt_tokens": "4"})
    assert Agreement(run, 4, [7, 3, 9], [0.0, NEAR_TIE / 2, 0.0]).agrees
    a = Agreement(run, 4, [7, 3, 9], [0.0, NEAR_TIE * 2, 0.0])
    assert not a.agrees and a.first_wrong == 1
    assert a.error().one_line().startswith("[runner] llmcore_runner: its token at step 1 of 3 (8)")
    b = Agreement(run, 5, [7, 8, 9], [0.0] * 3)
    assert not b.agrees and "the two tokenizers disagree" in b.line()


def test_the_runners_output_is_read_with_its_text_and_stats():
    run = parse_runner_output("Paris.\nids: 4 5 2\n", "x\nstats: ttft_ms=1.0 prompt_tokens=37 stop=eos\n")
    assert run.ids == [4, 5, 2] and run.text == "Paris." and run.stats["prompt_tokens"] == "37"


def test_the_check_fails_in_one_line_when_a_runner_prints_other_tokens(exports, tmp_path):
    """``python -m llmcore.runtime.agreement`` (what ``make demo`` runs) against a stand-in runner
    that answers newlines, as the broken runner did: exit 1, one line saying where."""
    pte = exports("xnnpack").pte
    ids = greedy_ids(pte, 8)
    fake = tmp_path / "llmcore_runner"
    fake.write_text("#!/bin/sh\nprintf '\\n\\n\\n\\nids: " + " ".join(["0"] * 8) + "\\n'\n"
                    "echo 'stats: ttft_ms=1 generated_tokens=8 stop=max_new_tokens' >&2\n")
    fake.chmod(0o755)
    if all(i == 0 for i in ids):
        pytest.skip("the program's own answer is token 0")
    done = subprocess.run([sys.executable, "-m", "llmcore.runtime.agreement", str(pte), "--runner", str(fake), "--prompt",
                           PROMPT, "--max-new-tokens", "8", "--show-text"], capture_output=True, text=True,
                          env=os.environ | {"PYTHONWARNINGS": "ignore"})
    errors = [line for line in done.stderr.splitlines() if line.startswith("llmcore: error:")]
    assert done.returncode == 1, done.stderr
    assert len(errors) == 1 and "scores" in errors[0] and "below Python's choice" in errors[0], done.stderr
    assert done.stdout.startswith("\n\n\n")  # the runner's text, shown as the demo shows it
