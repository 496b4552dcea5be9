"""Write the Python runtime's logits for a fixed token sequence on each program given:
``python program_logits.py OUT.pt PROGRAM.pte ...`` (``torch.save`` of {path: [calls, V]}).

Run under an ISA view (test_recipes_agree.py) it shows what each program computes with the
kernels that view picks. The tokens are fixed, not generated, so every view makes the same
calls: a prefill of eight tokens, then four decode steps."""

from __future__ import annotations

import sys

import torch

from llmcore.runtime.program import Program

TOKENS = [5, 17, 42, 99, 7, 64, 3, 120, 11, 250, 31, 8]
PREFILL = 8


def program_logits(path: str) -> torch.Tensor:
    program = Program.load(path)
    rows = [program.logits(TOKENS[:PREFILL], 0).float()]
    rows += [program.logits([token], pos).float() for pos, token in enumerate(TOKENS) if pos >= PREFILL]
    return torch.stack(rows)


if __name__ == "__main__":
    out, *paths = sys.argv[1:]
    torch.save({path: program_logits(path) for path in paths}, out)
