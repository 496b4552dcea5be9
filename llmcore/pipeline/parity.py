"""Stage 7: run the written program with the ExecuTorch runtime and compare with eager.

The eager reference is the module the program was captured from, after transforms and
quantization, so the check measures lowering and serialisation, not the quantizer. It runs
the example prompt at two lengths (the whole prompt and its first token), which exercises
the dynamic sequence length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from llmcore.errors import LlmcoreError
from llmcore.runtime import Program, captured_stderr


@dataclass
class ParityResult:
    max_abs_diff: float
    top1_agreement: float
    lengths: list[int]
    reference: str

    def as_dict(self) -> dict:
        return asdict(self)


def check_parity(
    buffer: bytes,
    eager: Any,
    prompt_ids: list[int],
    use_kv_cache: bool,
    reference: str,
    runtime_imports: list[str] = (),
) -> ParityResult:
    """Without a cache: the first token and the whole prompt. With one: a prefill of all
    but the last prompt token, then one decode step at the next position."""
    from llmcore.runtime import load_runtime_libraries

    load_runtime_libraries(runtime_imports)
    program = Program.load(bytes(buffer))
    if use_kv_cache and len(prompt_ids) >= 2:
        calls = [(prompt_ids[:-1], 0), (prompt_ids[-1:], len(prompt_ids) - 1)]
    else:
        calls = [(prompt_ids[:n], 0 if use_kv_cache else None) for n in sorted({1, len(prompt_ids)})]
    worst, agree = 0.0, 0
    for ids, pos in calls:
        tokens = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad(), captured_stderr():
            if use_kv_cache:
                expected = eager(tokens, torch.tensor([pos], dtype=torch.long))
            else:
                expected = eager(tokens)
        expected = expected.reshape(-1, expected.shape[-1])[-1].float()
        got = program.logits(ids, pos).float()
        worst = max(worst, float((got - expected).abs().max()))
        agree += int(torch.argmax(got) == torch.argmax(expected))
    return ParityResult(round(worst, 6), agree / len(calls), [len(ids) for ids, _ in calls], reference)


def enforce(result: ParityResult, tolerance: Optional[float]) -> None:
    if tolerance is not None and result.max_abs_diff > tolerance:
        raise LlmcoreError(
            f"parity check failed: max |logit difference| {result.max_abs_diff:.4g} exceeds "
            f"--strict-parity {tolerance:g} (top-1 agreement {result.top1_agreement:.0%}).",
            stage="parity",
            fix="loosen --strict-parity, or try another quantizer recipe or backend.",
        )
