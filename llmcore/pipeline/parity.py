"""Stage 7: run the written program with the ExecuTorch runtime and compare with eager.

The eager reference is the module the program was captured from, after transforms and
quantization, so the check measures lowering and serialisation, not the quantizer. It runs
the example prompt at two lengths (the whole prompt and its first token), which exercises
the dynamic sequence length.

A program whose delegates need a backend this runtime lacks (a GPU or NPU backend on a
Linux build machine) cannot be run here: the check is then skipped, and the report says
which backend is missing and where it runs. ``--strict-parity`` refuses such a skip.
"""

from __future__ import annotations

import mmap
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from llmcore.builtins.kv_cache import plain_attention
from llmcore.errors import LlmcoreError
from llmcore.runtime import Program, backend_target, captured_stderr, missing_backends


# A call whose two top-1 tokens differ is a near tie when the program's own logits for the
# two are closer than this: a last-bit difference anywhere upstream can pick either.
NEAR_TIE_LOGITS = 0.1


@dataclass
class ParityResult:
    max_abs_diff: float
    top1_agreement: float
    lengths: list[int]
    reference: str
    # calls whose top-1 tokens differ while the program holds them within NEAR_TIE_LOGITS,
    # and the smallest such gap (None when there is none)
    near_ties: int = 0
    near_tie_gap: Optional[float] = None
    # each call whose top-1 tokens differ: its length, how far the reference ranks the
    # program's top-1 below its own (``reference_margin``), and the call's own largest
    # |logit difference|. A program whose int8 activations move its logits by ~2 (the GGUF
    # recipes on the kernels) picks the other token of a pair the reference holds 0.6 apart
    # as often as not; one that is wrong disagrees where the reference is sure.
    disagreements: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ParitySkipped:
    """The program was not run: this runtime lacks a backend its delegates need."""

    skipped: str
    missing_backends: list[str]
    reference: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ReferenceCall:
    """One call of the parity check and the eager model's logits for it."""

    ids: list[int]
    pos: Optional[int]
    logits: torch.Tensor


def parity_calls(prompt_ids: list[int], use_kv_cache: bool) -> list[tuple[list[int], Optional[int]]]:
    """Without a cache: the first token and the whole prompt. With one: a prefill of all
    but the last prompt token, then one decode step at the next position."""
    if use_kv_cache and len(prompt_ids) >= 2:
        return [(prompt_ids[:-1], 0), (prompt_ids[-1:], len(prompt_ids) - 1)]
    return [(prompt_ids[:n], 0 if use_kv_cache else None) for n in sorted({1, len(prompt_ids)})]


def reference_logits(
    eager: Any, prompt_ids: list[int], use_kv_cache: bool, written: Optional[Sequence[torch.Tensor]] = None
) -> list[ReferenceCall]:
    """The eager model's logits for each parity call, taken before lowering so the eager
    model can be freed while the program is lowered, serialised and loaded (on a 135M
    model it is the largest thing held besides the program).

    Running the model writes its KV-cache buffers, which the captured program shares as
    initial values: they are restored afterwards, so the program's bytes do not depend on
    this check. ``written``: the buffers the captured program writes (:func:`written_buffers`),
    restored whatever their type (:func:`buffers_restored`).

    The cached attention runs in plain PyTorch (:func:`~llmcore.builtins.kv_cache.plain_attention`):
    ExecuTorch's eager ``custom_sdpa`` is not the same bits from call to call, and the
    reference must be."""
    out = []
    with buffers_restored(eager, written), plain_attention():
        for ids, pos in parity_calls(prompt_ids, use_kv_cache):
            tokens = torch.tensor([ids], dtype=torch.long)
            with torch.no_grad(), captured_stderr():
                if use_kv_cache:
                    expected = eager(tokens, torch.tensor([pos], dtype=torch.long))
                else:
                    expected = eager(tokens)
            out.append(ReferenceCall(ids, pos, expected.reshape(-1, expected.shape[-1])[-1].float().clone()))
    return out


def written_buffers(exported: Any) -> list[torch.Tensor]:
    """The buffers an exported program writes (its KV caches), as the tensors it shares
    with the eager model."""
    tensors = {**exported.state_dict, **exported.constants}
    return [tensors[name] for name in exported.graph_signature.buffers_to_mutate.values() if name in tensors]


@contextmanager
def buffers_restored(module: Any, written: Optional[Sequence[torch.Tensor]] = None) -> Iterator[None]:
    """Run the model inside and get its buffers back as they were: a KV cache the calls
    wrote is the captured (or to be captured) program's initial value, which must not
    depend on what was run to check or calibrate it.

    A buffer whose bytes are all zero (a KV cache) is zeroed afterwards; a floating-point
    one, or one of ``written`` (the buffers the captured program writes), is copied first.
    The others, a quantized model's integer weights, are not copied (copies of them raised
    the export's peak by the weights' size): their version counters are checked
    instead, and an eager model that wrote one, which would have changed the program's
    weights, fails here."""
    storages = {t.untyped_storage().data_ptr() for t in written or ()}
    saved, watched = [], []
    for name, b in module.named_buffers():
        version = _version_of(b)
        if _all_zero_bytes(b):
            saved.append((b, None))
        elif b.is_floating_point() or b.untyped_storage().data_ptr() in storages or version is None:
            saved.append((b, b.clone()))
        else:
            watched.append((name, b, version))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, initial in saved:
                buffer.zero_() if initial is None else buffer.copy_(initial)
    changed = [name for name, b, version in watched if b._version != version]
    if changed:
        raise LlmcoreError(
            f"the eager model wrote integer buffer {changed[0]!r} in place, and it was not saved: the "
            "exported program's copy of it may have changed.",
            stage="parity",
            fix="this is a bug in the model family plugin (its eager forward writes an integer buffer its "
                "exported graph does not declare as written): please report it.",
        )


def _all_zero_bytes(tensor: torch.Tensor) -> bool:
    """Every byte of the tensor is zero (so ``zero_()`` restores it exactly, -0.0 included)."""
    if tensor.numel() == 0:
        return True
    if not tensor.is_contiguous():  # no byte view without a copy: treated as not zero, so copied
        return False
    return not bool(tensor.detach().reshape(-1).view(torch.uint8).any())


def _version_of(tensor: torch.Tensor) -> Optional[int]:
    """The tensor's in-place write counter; None for an inference-mode tensor, which has none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def check_parity(
    program_source: "bytes | str",
    expected: list[ReferenceCall],
    reference: str,
    runs_on: Optional[Mapping[str, str]] = None,
) -> ParityResult | ParitySkipped:
    """Run the program (its bytes, or the path of the staged file, which the runtime maps
    instead of copying) on the calls of ``expected`` and compare the logits.

    ``runs_on`` maps a backend id to where it runs (``Backend.runs_on``), for the reason
    given when the check is skipped."""
    if isinstance(program_source, (bytes, bytearray)):
        missing = missing_backends(bytes(program_source))
    else:  # only the program table is read, through a mapping: the weights stay on disk
        with open(program_source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            missing = missing_backends(mapped)
    if missing:
        where = dict(runs_on or {})
        reason = "; ".join(
            f"backend {b} is not in this runtime; it runs on {where.get(b) or backend_target(b)}" for b in missing
        )
        return ParitySkipped(reason, missing, reference)
    # mapped, not read into huge pages: a few calls, in the process that holds the model too
    program = Program.load(program_source, map_file=True)
    worst, agree, gaps, disagreements = 0.0, 0, [], []
    for call in expected:
        got = program.logits(call.ids, call.pos).float()
        call_worst = float((got - call.logits).abs().max())
        worst = max(worst, call_worst)
        ours, theirs = int(torch.argmax(got)), int(torch.argmax(call.logits))
        agree += int(ours == theirs)
        if ours != theirs:
            gap = float(got[ours] - got[theirs])  # the program's preference for its own top-1
            if gap <= NEAR_TIE_LOGITS:
                gaps.append(gap)
            margin = float(call.logits[theirs] - call.logits[ours])
            disagreements.append({"length": len(call.ids), "reference_margin": round(margin, 6),
                                  "max_abs_diff": round(call_worst, 6)})
    return ParityResult(
        round(worst, 6), agree / len(expected), [len(c.ids) for c in expected], reference,
        near_ties=len(gaps), near_tie_gap=round(min(gaps), 6) if gaps else None, disagreements=disagreements,
    )


def enforce(result: ParityResult | ParitySkipped, tolerance: Optional[float]) -> None:
    if tolerance is not None and isinstance(result, ParitySkipped):
        raise LlmcoreError(
            f"--strict-parity {tolerance:g} needs a parity check, and it could not run: {result.skipped}.",
            stage="parity",
            fix="drop --strict-parity for this backend (the program runs only on its devices), or export "
            "where the ExecuTorch runtime has the backend.",
        )
    if tolerance is not None and result.max_abs_diff > tolerance:
        raise LlmcoreError(
            f"parity check failed: max |logit difference| {result.max_abs_diff:.4g} exceeds "
            f"--strict-parity {tolerance:g} (top-1 agreement {result.top1_agreement:.0%}).",
            stage="parity",
            fix="loosen --strict-parity, or try another quantizer recipe or backend.",
        )
