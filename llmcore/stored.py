"""Weights as the checkpoint stores them: integers and per-block scales, kept beside the floats.

A quantized checkpoint (a GGUF's Q4_1 linears, say) already holds integers that someone
chose with care. Loaders dequantize every tensor so that the eager model, the parity
reference and float recipes work as usual; a loader that can also say *which integers and
scales* a weight came from hands them over as :class:`IntegerWeight` records, and a
quantizer recipe that can carry them into the program (XNNPACK's ``gguf`` recipe) puts them
in unchanged instead of rounding the dequantized floats a second time.

The records travel with the weight tensors themselves (``remember`` / ``integer_form``), not
with module names: source transforms replace modules (KV-cache attention, norms) but keep the
weights, and a weight a transform rebuilt simply has no integer form any more, which a recipe
reports by name instead of silently using stale integers.

A loader may also leave such a weight in the file (:class:`FileWeight`): the parameter is
then on the meta device, and a recipe reads its integers (:func:`stored_form`) or its floats a
few rows at a time (:func:`float_rows`) when it replaces the layer, so that no export holds a
quantized model's weights as fp32 (4 bytes a weight, 7x a Q4_0 file). What no recipe
replaced is read whole before capture (:func:`materialize`).

A float checkpoint (a bf16 safetensors folder) can be left in its file the same way for a
recipe that rounds float weights one layer at a time (``8da4w``): its calibration runs the
model with each module reading its own weights as it runs (:func:`read_while_running`), its
channel scales are recorded on the file's weights rather than written into them
(:func:`rescale`), and each linear is read whole (:func:`floats`) when it is replaced. The
export then holds one layer in fp32, never the model (fp32 is twice a bf16 file).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from llmcore.progress import before_own_mapping, stop_if_interrupted

_FORMS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass(frozen=True)
class IntegerWeight:
    """``weight[o, i] == scales[o, i // block] * q[o, i] + offsets[o, i // block]`` (fp32).

    ``q`` is int8 ``[out, in]``; ``scales`` and ``offsets`` are float32 ``[out, in // block]``,
    ``offsets`` None where the format has none (Q4_0, Q8_0). ``bits`` is how many bits the
    integers use: 4-bit formats store ``q`` in ``[-8, 7]`` (a GGUF's unsigned nibbles minus 8,
    the 8 moved into the offsets), 8-bit ones in ``[-128, 127]``.
    """

    format: str
    """The checkpoint's name for the encoding, e.g. ``Q4_1`` (GGML type names)."""
    source_name: str
    """The tensor's name in the checkpoint file, for messages."""
    bits: int
    block: int
    q: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor] = None
    headers: Optional[torch.Tensor] = None
    """For a format whose scales are codes under a header a super-block (Q4_K): those headers
    as the file stores them, uint8 ``[out, in // 256, 16]``, which ``scales`` and ``offsets``
    are computed from (:func:`q4_k_block_values`) and a backend can compute from as they are;
    None for other formats."""

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.q.shape
        w = self.q.float().view(rows, cols // self.block, self.block) * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            w = w + self.offsets.unsqueeze(-1)
        return w.reshape(rows, cols)


def k_quant_codes(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF k-quant super-block's 12 bytes of 6-bit codes (Q4_K's and Q5_K's, uint8
    ``[..., 12]``) -> its 8 blocks' scale codes and minimum codes, int32 ``[..., 8]`` each.
    Blocks 0-3 keep the six low bits of bytes 0-3 (scales) and 4-7 (minima); blocks 4-7 take
    four bits from bytes 8-11 (a scale's low nibble, a minimum's high one) and their top two
    from the top two bits of bytes 0-3 (scales) and 4-7 (minima)."""
    c = codes.to(torch.int32)
    scales_low, minima_low = c[..., 0:4] & 63, c[..., 4:8] & 63
    scales_high = (c[..., 8:12] & 0x0F) | ((c[..., 0:4] >> 6) << 4)
    minima_high = (c[..., 8:12] >> 4) | ((c[..., 4:8] >> 6) << 4)
    return torch.cat((scales_low, scales_high), dim=-1), torch.cat((minima_low, minima_high), dim=-1)


Q4_K_HEADER_BYTES = 16
"""A Q4_K super-block's header: float16 ``d``, float16 ``dmin``, 12 bytes of codes; its 128
bytes of nibbles (256 values) follow."""


def q4_k_block_values(headers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks' headers (uint8 ``[..., 16]``) -> each block of 32's scale and offset,
    float32 ``[..., 8]``, for ``weight = scale * (u - 8) + offset`` (``u`` the nibble): the
    scale ``d * sc`` (exact), the offset ``8 * scale - dmin * m`` (rounded once). The values a
    Q4_K :class:`IntegerWeight` holds, and the ones llmcore-kernels computes from the same
    header bytes (csrc/int4_gemm.h, ``Format::q4_k``)."""
    halves = headers[..., 0:4].contiguous().view(torch.float16).float()
    sc, m = k_quant_codes(headers[..., 4:16])
    scales = halves[..., 0:1] * sc.float()
    return scales, -(halves[..., 1:2] * m.float()) + 8.0 * scales


@dataclass(frozen=True)
class StoredFormat:
    """A weight the checkpoint stored in a form with no :class:`IntegerWeight` (F16, Q6_K, ...):
    only its name, so a recipe can say which tensors it had to round afresh."""

    format: str
    source_name: str


@dataclass(frozen=True)
class FileWeight:
    """A weight left in the checkpoint file (a quantized one, or a float one for a recipe that
    reads layer by layer), read when a recipe needs it.

    ``read_floats(rows)`` gives fp32 rows ``[len(rows), cols]`` exactly as the loader would
    have dequantized them (a slice of the rows: memory for those rows only; a tensor of its
    own each call, which the caller may change);
    ``read_integers()`` its :class:`IntegerWeight` (None where the type has none);
    ``read_blocks()`` its bytes as the file stores them, uint8 ``[rows, blocks a row, bytes a
    block]`` in the model's row order (None where the loader gives none): for a backend whose kernels compute
    that format as it is (a GGUF's Q6_K output layer, say), where no :class:`IntegerWeight`
    holds it without a second rounding or a wider form. Each read decodes the file again: a
    recipe reads what it keeps once, when it replaces the layer.
    """

    format: str
    source_name: str
    shape: tuple
    read_floats: Callable[[slice], torch.Tensor]
    read_integers: Optional[Callable[[], Optional[IntegerWeight]]] = None
    read_blocks: Optional[Callable[[], torch.Tensor]] = None

    @property
    def has_integers(self) -> bool:
        return self.read_integers is not None


class FloatRows:
    """A :class:`FileWeight`'s floats as code that reads a weight a few rows at a time sees
    them: ``rows[a:b]`` (fp32), ``shape``, ``detach()``; never the whole matrix at once."""

    def __init__(self, form: FileWeight):
        self.form = form
        self.shape = torch.Size(form.shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"{self.form.source_name}: rows of a weight in the file are read by a plain slice")
        return self.form.read_floats(rows)

    def detach(self) -> "FloatRows":
        return self


def stored_rows(form: "IntegerWeight | StoredFormat | FileWeight", start: int, stop: int):
    """Rows ``[start, stop)`` of a loader's record, as a record of the same kind: for a
    transform that splits a stored matrix by its rows (nanoGPT's q, k and v from one ``c_attn``),
    so that each part still carries the checkpoint's integers, or is still read from the file
    (a row keeps its blocks, so its integers are the whole matrix's rows)."""
    if isinstance(form, IntegerWeight):
        offsets = None if form.offsets is None else form.offsets[start:stop]
        headers = None if form.headers is None else form.headers[start:stop]
        return replace(form, q=form.q[start:stop], scales=form.scales[start:stop], offsets=offsets, headers=headers)
    if not isinstance(form, FileWeight):
        return form  # a StoredFormat: only the format's name, the same for every row

    def read_floats(rows: slice) -> torch.Tensor:
        first, last, _ = rows.indices(stop - start)
        return form.read_floats(slice(start + first, start + last))

    def read_integers() -> Optional[IntegerWeight]:
        whole = form.read_integers()
        return None if whole is None else stored_rows(whole, start, stop)

    def read_blocks() -> torch.Tensor:
        return form.read_blocks()[start:stop]

    return FileWeight(form.format, form.source_name, (stop - start, *form.shape[1:]), read_floats,
                      read_integers if form.read_integers is not None else None,
                      read_blocks if form.read_blocks is not None else None)


def remember(weight: torch.Tensor, form: "IntegerWeight | StoredFormat | FileWeight") -> None:
    _FORMS[weight] = form


def stored_form(weight: Any) -> "IntegerWeight | StoredFormat | None":
    """What the checkpoint stored for this weight tensor, or None (float checkpoints, or a
    weight that a transform rebuilt). A weight still in the file is read here: its
    :class:`IntegerWeight` (held only as long as the caller holds it), or its type's name."""
    form = record(weight)
    if isinstance(form, FileWeight):
        integers = form.read_integers() if form.read_integers is not None else None
        return integers if integers is not None else StoredFormat(form.format, form.source_name)
    return form


def stored_blocks(weight: Any) -> Optional[torch.Tensor]:
    """The bytes of a weight still in the file as the file stores them (:attr:`FileWeight.read_blocks`,
    read here), or None where the loader gives none; the format is :func:`record`'s."""
    form = record(weight)
    if isinstance(form, FileWeight) and form.read_blocks is not None:
        return form.read_blocks()
    return None


def record(weight: Any) -> "IntegerWeight | StoredFormat | FileWeight | None":
    """What the loader recorded for ``weight``, without reading the file (:func:`stored_form` reads)."""
    return _FORMS.get(weight) if isinstance(weight, torch.Tensor) else None


def has_integers(form: Any) -> bool:
    """Whether a loader's record for a weight holds integers a recipe can keep."""
    return isinstance(form, IntegerWeight) or (isinstance(form, FileWeight) and form.has_integers)


def in_file(weight: Any) -> bool:
    """Whether ``weight`` is a parameter the loader left in the checkpoint file (meta)."""
    return isinstance(record(weight), FileWeight)


def any_in_file(module: torch.nn.Module) -> bool:
    """Whether any parameter of ``module`` is still in the checkpoint file."""
    return any(isinstance(_FORMS.get(p), FileWeight) for p in module.parameters())


def layer_read_bytes(module: torch.nn.Module) -> int:
    """The most bytes one read of a weight of ``module`` still in the file takes as floats,
    the largest weight set aside: a pass over the model (:func:`read_while_running`) reads
    each layer's weights, then drops them for the next layer's, and can serve them from the
    heap's reused pages (:func:`llmcore.progress.heap_for_temporaries`); the largest weight
    (a vocabulary's table, read once a pass) keeps a mapping of its own. 0 for none in the file."""
    sizes = sorted({p.numel() * 4 for p in module.parameters() if isinstance(_FORMS.get(p), FileWeight)})
    return sizes[-2] if len(sizes) > 1 else 0


def pass_temporaries(module: torch.nn.Module, at_least: int) -> int:
    """The ``largest`` for a :func:`llmcore.progress.heap_for_temporaries` scope over a pass
    through ``module``'s layers: ``at_least``, or a layer's weight read from the file as
    floats (:func:`layer_read_bytes`) and a MiB of room, so that each layer's read reuses the
    heap's pages where the weight's exact size was its own mapping again."""
    return max(at_least, layer_read_bytes(module) + 2**20)


def float_rows(weight: torch.Tensor) -> "torch.Tensor | FloatRows":
    """``weight`` as something read by rows (``w[a:b]``, ``w.shape``): the tensor itself, or
    for a weight still in the file a :class:`FloatRows` that reads those rows only."""
    form = record(weight)
    return FloatRows(form) if isinstance(form, FileWeight) else weight


def floats(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` whole as fp32: read from the file for a weight still there, else the
    tensor itself (detached, converted if it is not fp32)."""
    form = record(weight)
    if isinstance(form, FileWeight):
        return form.read_floats(slice(None)).float()
    return weight.detach().float()


def rescale(weight: torch.Tensor, rows: Optional[torch.Tensor] = None,
            cols: Optional[torch.Tensor] = None) -> bool:
    """Record on a weight still in the file that its rows are to be divided by ``rows`` and
    its input columns multiplied by ``cols`` (channel scales folded before rounding) when it
    is read; returns False, changing nothing, for a weight that is not in the file (the
    caller scales the tensor). Reads stay exact: the scaling is done in fp32 on the rows read."""
    form = record(weight)
    if not isinstance(form, FileWeight):
        return False
    read = form.read_floats

    def read_scaled(selected: slice) -> torch.Tensor:
        w = read(selected).float()  # rows of its own (read from the file): scaled in place
        if rows is not None:
            w.div_(rows[selected].float().view(-1, *([1] * (w.dim() - 1))))
        return w.mul_(cols.float()) if cols is not None else w

    remember(weight, FileWeight(form.format, form.source_name, form.shape, read_scaled, None))
    return True


ROWS_READ_BYTES = 16 * 2**20
"""How much of a weight :func:`read_while_running` reads at a time (as fp32) for a linear it
computes by rows (:func:`_linear_by_rows`)."""


@contextmanager
def read_while_running(module: torch.nn.Module):
    """Within the block, each submodule of ``module`` that has weights still in the file reads
    them (as floats, in the parameter's dtype) just before it runs and lets them go as soon as
    it returns, so that a forward pass (a recipe's calibration) holds one module's weights at
    a time instead of the model's. Outside the block such modules refuse to run as before.

    A plain linear whose weight is larger than every layer's (:func:`layer_read_bytes`: a
    vocabulary's output layer) is computed a few rows of its weight at a time instead
    (:func:`_linear_by_rows`): read whole, a 1B's tied output layer was 1.5 GiB of fresh pages
    (its bf16 bytes, then its floats) in each of an ``8da4w`` export's three passes, and its
    peak (docs/performance.md, "Measurements behind the code")."""
    handles = []
    largest = layer_read_bytes(module)
    by_rows = [sub for sub in module.modules() if _computed_by_rows(sub, largest)]

    def read(owner: torch.nn.Module, args) -> None:
        stop_if_interrupted()  # a module's read is a step of its own: a Ctrl-C waits no longer
        kept = owner.__dict__.setdefault("_llmcore_in_file", {})
        for name, param in list(owner.named_parameters(recurse=False)):
            form = _FORMS.get(param)
            if isinstance(form, FileWeight):
                kept[name] = param
                if type(owner) is torch.nn.Embedding and name == "weight":
                    floats = _rows_looked_up(form, args[0], param.dtype)
                else:
                    before_own_mapping(param.numel() * 4)  # read as fp32
                    floats = form.read_floats(slice(None)).to(param.dtype)
                setattr(owner, name, torch.nn.Parameter(floats, requires_grad=False))

    def release(owner: torch.nn.Module, _args, _output) -> None:
        for name, param in owner.__dict__.pop("_llmcore_in_file", {}).items():
            setattr(owner, name, param)

    for sub in module.modules():
        if sub in by_rows:
            sub.forward = _linear_by_rows.__get__(sub)  # this instance's forward, for the block
            sub._llmcore_reads_rows = True
            handles.append(sub.register_forward_pre_hook(lambda *_: stop_if_interrupted(), prepend=True))
        elif any(isinstance(_FORMS.get(p), FileWeight) for p in sub.parameters(recurse=False)):
            # first of its pre-hooks: the guard that refuses weights in the file then sees floats
            handles.append(sub.register_forward_pre_hook(read, prepend=True))
            handles.append(sub.register_forward_hook(release, always_call=True))
    try:
        yield module
    finally:
        for handle in handles:
            handle.remove()
        for sub in by_rows:
            del sub.forward, sub._llmcore_reads_rows


def _computed_by_rows(module: torch.nn.Module, largest: int) -> bool:
    """Whether :func:`read_while_running` computes ``module`` by rows: a plain linear whose
    weight is in the file and larger (as fp32) than ``largest``, its bias (if any) in memory."""
    if type(module) is not torch.nn.Linear or not largest:
        return False
    weight = module.weight
    return (isinstance(_FORMS.get(weight), FileWeight) and weight.numel() * 4 > largest
            and not (module.bias is not None and isinstance(_FORMS.get(module.bias), FileWeight)))


def _linear_by_rows(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``self(x)`` with its weight read from the file :data:`ROWS_READ_BYTES` at a time: each
    output column is its own row's dot product, as in one call (the pieces' temporaries reuse
    the heap's pages within a calibration call, where a whole read took fresh ones)."""
    form = _FORMS[self.weight]
    rows, cols = form.shape
    step = max(1, ROWS_READ_BYTES // (4 * cols))
    out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        out[..., start:stop] = torch.nn.functional.linear(x, form.read_floats(slice(start, stop)).to(x.dtype))
    return out if self.bias is None else out.add_(self.bias)


def _rows_looked_up(form: FileWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An embedding table of ``form``'s shape holding the rows ``ids`` look up, read from the
    file; its other rows are left unwritten (their pages never touched), which the lookup of
    ``ids`` never reads. A 1B's tied table is 1 GiB as floats, read whole for each calibration
    pass before, where a pass of 461 tokens looks up at most 461 rows."""
    table = torch.empty(form.shape, dtype=dtype)
    for rows in id_runs(torch.unique(ids.detach().reshape(-1))):
        table[rows] = form.read_floats(rows).to(dtype)
    return table


def id_runs(wanted: torch.Tensor) -> list[slice]:
    """Sorted distinct row ids (``torch.unique``'s) as runs of consecutive ids, one slice a
    run, in order: a lookup's rows read from the file one run at a time, not one row at a time."""
    ids = wanted.tolist()
    runs, start = [], 0
    while start < len(ids):
        stop = start + 1
        while stop < len(ids) and ids[stop] == ids[stop - 1] + 1:
            stop += 1
        runs.append(slice(ids[start], ids[stop - 1] + 1))
        start = stop
    return runs


def materialize(module: torch.nn.Module) -> list[str]:
    """Read every parameter of ``module`` still in the file as floats (in its dtype); returns
    their names. A parameter shared by two names (a tied table) is read once."""
    read: dict[int, torch.nn.Parameter] = {}
    names = []
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        form = _FORMS.get(param)
        if not isinstance(form, FileWeight):
            continue
        if id(param) not in read:
            floats = form.read_floats(slice(None)).to(param.dtype)
            read[id(param)] = torch.nn.Parameter(floats, requires_grad=False)
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, attr, read[id(param)])
        names.append(name)
    return names


def attach(module: torch.nn.Module, forms: Mapping[str, "IntegerWeight | StoredFormat"]) -> int:
    """Tie ``forms`` (keyed by parameter name) to ``module``'s parameters; returns how many.

    A parameter shared by two names (a tied embedding and output layer) gets the one form.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    done = 0
    for name, form in forms.items():
        if name in params:
            remember(params[name], form)
            if isinstance(form, FileWeight):
                owner = name.rpartition(".")[0]
                _guard(module.get_submodule(owner) if owner else module)
            done += 1
    return done


def _guard(module: torch.nn.Module) -> None:
    """Make ``module`` refuse to run while a weight of its own is still in the file: a meta
    weight in a CPU computation can give uninitialised memory instead of an error."""
    if getattr(module, "_llmcore_file_guard", None) is None:
        module._llmcore_file_guard = module.register_forward_pre_hook(_refuse_weights_in_file)


def _refuse_weights_in_file(module: torch.nn.Module, args) -> None:
    if module.__dict__.get("_llmcore_reads_rows"):  # read_while_running computes it by rows
        return
    for param in module.parameters(recurse=False):
        form = _FORMS.get(param)
        if isinstance(form, FileWeight):
            from llmcore.errors import LlmcoreError

            raise LlmcoreError(
                f"{form.source_name} ({form.format}) is still in the checkpoint file: it was left there for a "
                "recipe that reads the file's weights itself, and has not been read.",
                stage="load",
                fix="load with LoadOptions(stored_integers=False, weights_in_file=False) for float weights, or read "
                    "them first with llmcore.stored.materialize(module) (or run within llmcore.stored.read_while_running).",
            )
