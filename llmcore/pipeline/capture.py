"""Stage 3: capture the module with torch.export, the sequence length left dynamic.

The inputs follow ``docs/pte-contract.md``: ``(tokens,)`` or, once a KV-cache transform
has run, ``(tokens, input_pos)``. Errors from deep inside torch.export are turned into one
line that names the model family and the likely fix.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from llmcore.errors import stage_errors


def example_inputs(prompt_ids: list[int], use_kv_cache: bool) -> tuple:
    tokens = torch.tensor([prompt_ids], dtype=torch.long)
    if use_kv_cache:
        return (tokens, torch.tensor([0], dtype=torch.long))
    return (tokens,)


def dynamic_shapes(max_seq_len: int, use_kv_cache: bool) -> tuple:
    seq = torch.export.Dim("seq_len", min=1, max=max_seq_len)
    if use_kv_cache:
        return ({1: seq}, None)
    return ({1: seq},)


def capture(
    module: Any,
    inputs: tuple,
    max_seq_len: int,
    use_kv_cache: bool,
    *,
    family: str,
    what: str = "the model",
) -> torch.export.ExportedProgram:
    from executorch.exir.passes.remove_unused_parameters_pass import remove_unused_parameters_pass

    failed = f"torch.export could not capture {what} with a dynamic sequence length (1..{max_seq_len})"
    with stage_errors("export", family, failed, fix=_hint), torch.no_grad():
        exported = torch.export.export(
            module, inputs, dynamic_shapes=dynamic_shapes(max_seq_len, use_kv_cache), strict=False
        )
    # What to_edge removes first, with ExecuTorch's own pass, removed now: a parameter the
    # graph never reads (an fp32 embedding table whose lookups read its int8 copy: the
    # largest single tensor of a small model) is then not held beside the program while it
    # is lowered.
    return remove_unused_parameters_pass(exported)


@contextmanager
def source_lines(wanted: bool) -> Iterator[None]:
    """Tracing (torch.export, and every retrace after it) with or without each node's Python
    stack (``node.meta["stack_trace"]``).

    The stacks reach only an ETRecord (``llmcore profile`` names each operator's source
    line from it); the program itself never carries them (ExecuTorch emits them only when
    asked, and llmcore does not ask). Recording one walks the Python stack, once per traced
    operator, a fifth of ``torch.export``'s time (figures: docs/performance.md, "Measurements behind the code"). Off for the capture alone is not
    enough: a retrace records a fresh stack for every node that has none, so lowering then
    took longer instead."""
    import torch.fx.config as fx_config

    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = before or not wanted
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def _hint(exc: BaseException) -> str:
    text = str(exc)
    if "Constraints violated" in text or "specializ" in text or "guard" in text.lower():
        return (
            "the model's forward branches on the sequence length or specialises it; "
            "try another --max-seq-len, or make the model's shape logic symbolic (--debug shows the traceback)."
        )
    return "check the source transforms and the model's forward (--debug shows the traceback)."
