"""KV-cache source transforms, for every model family that attends through
:class:`llmcore.modules.CausalAttention`.

Both transforms swap each ``CausalAttention`` for a module that keeps keys and values of
past positions in buffers, and switch the program to ``forward(tokens, input_pos)``:

* ``kv-cache`` (on by default): ExecuTorch's LLM custom ops ``llama::update_cache``
  (writes the new rows in place) and ``llama::custom_sdpa`` (attends to positions
  ``[0, input_pos + T)`` only). The process that runs the program must load
  ``executorch.extension.llm.custom_ops.custom_ops``; llmcore's runners do.
* ``kv-cache-static``: plain PyTorch, for backends without those ops. The cache is
  written with ``index_put_`` so that ExecuTorch's re-inplace pass updates the buffer in
  place; an ``index_copy_`` cache would instead copy the whole cache every step.

Sliding-window layers (``CausalAttention.window``) keep only what their window needs: a
ring buffer of ``W + chunk - 1`` rows, position ``p`` in row ``p % rows``, where ``chunk``
is the most tokens one call takes (the shortest window, :func:`prefill_chunk`; the
program's ``get_max_seq_len``, and runners feed prompts in chunks of it). Memory and the
cost of a step then depend on the window, not the context, and generation runs past the
window up to the context (the full-attention layers' cache, and the RoPE tables) matching
transformers. The custom-op variant writes rows with ``llama::update_cache_with_indices``
and passes ``custom_sdpa`` an explicit ``[T, rows]`` mask of which position each row holds
(the op then ignores ``start_pos``); the plain-PyTorch one does the same with ``index_put_``
and a masked SDPA. When ``W + chunk - 1`` would not be shorter than the context, the layer
keeps a full-length cache with the window in its mask, and a call may take the whole
context. The masks, and the rows new positions go to, are computed once per forward
(:class:`WindowMasks`).

A layer's attention scale (``CausalAttention.scale``) goes to the SDPA op as it is. A layer
with soft-capped scores (``CausalAttention.softcap``: Gemma 2) attends, in the custom-op
variant, through ``llmcore::softcap_sdpa`` (:mod:`llmcore.builtins.runtime_attention`: the
runtime's attention kernel with the cap), a float cache at least and where that kernel is
built; otherwise (an int8 cache, no ``make runner``) with explicit matmuls over the whole
cache and the causal (or window) mask, static shapes that lower into the layer's XNNPACK
delegate, each decode step then reading every row of the cache. The plain-PyTorch variant
writes them out over the filled part.

The cache keeps ``cache_dtype`` (``--kv-cache-dtype``, :data:`llmcore.kv_cache.CACHE_DTYPES`).
``bf16``/``fp16``: keys and values are rounded to 16 bits as they are written, and the
custom-op cache attends in that type (``custom_sdpa`` takes queries, keys and values of one
type; the queries are rounded too, the output is fp32 again). ``int8``: each new row of a head
is rounded to int8 with its own scale and zero point (asymmetric, ``quantized_decomposed``'s
per-token arithmetic, as ExecuTorch's own quantized cache rounds; one ``llmcore::quantize_rows``
call where the runtime's library is built), kept in ``k_scales`` /
``k_zero_points`` (and ``v_``) beside the cache, and ``llama::custom_quantized_sdpa`` attends
over the integers, the queries rounded to int8 per token as well; the plain-PyTorch cache
does not take int8 (it would read the whole cache back as floats every step). Soft-capped
layers and the parity reference read a cache back as floats (:meth:`_CachedAttention.keys_values`).

What a backend plugin may rely on of these classes is declared in :mod:`llmcore.kv_cache`
(a :class:`~llmcore.records.KVCacheForm` each), which plugins import them from.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
from contextlib import contextmanager
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from llmcore import hookimpl, kv_cache as forms
from llmcore.errors import LlmcoreError
from llmcore.builtins import runtime_attention
from llmcore.builtins.executorch_kernels import LLM_CUSTOM_OPS_MODULE, QUANTIZED_KERNELS_MODULE
from llmcore.modules import CausalAttention, attention_mask, explicit_attention, repeat_kv, replace_modules
from llmcore.records import CallingConvention, KVCacheForm, SourceTransform, Transformed, TransformContext

# the module whose import registers torch.ops.llama.* (and their runtime kernels)
CUSTOM_OPS_MODULE = LLM_CUSTOM_OPS_MODULE


def _start(input_pos: torch.Tensor, seq_len: int, capacity: int) -> int:
    start = input_pos[0].item()
    torch._check(start >= 0)
    torch._check(start + seq_len <= capacity)
    return start


def _window(window: Optional[int], capacity: int) -> Optional[int]:
    """The window a cache must apply: none when it holds no more than the window anyway."""
    return window if window is not None and window < capacity else None


def ring_slots(window: Optional[int], chunk: Optional[int], capacity: int) -> Optional[int]:
    """Rows of a sliding layer's ring buffer: the ``window - 1`` positions before a chunk of
    up to ``chunk`` new ones, when that is fewer than ``capacity``; None: a full cache."""
    if window is None or chunk is None or window + chunk - 1 >= capacity:
        return None
    return window + chunk - 1


def slot_positions(end, slots: int) -> torch.Tensor:
    """The position each row of a ring buffer of ``slots`` rows holds once positions
    ``[0, end)`` were written in order, position ``p`` to row ``p % slots``: the last ``p <
    end`` of each row's residue. Negative: the row was never written."""
    return (end - 1) - torch.remainder((end - 1) - torch.arange(slots), slots)


def ring_rows(input_pos: torch.Tensor, seq_len: int, slots: int) -> torch.Tensor:
    """``[1, T]`` rows of a ring buffer of ``slots`` rows that positions ``input_pos[0] + t``
    are written to (``llama::update_cache_with_indices``' layout)."""
    start = input_pos[0].item()
    torch._check(start >= 0)
    return torch.remainder(torch.arange(start, start + seq_len), slots).unsqueeze(0)


def window_mask(
    input_pos: torch.Tensor, seq_len: int, capacity: int, window: Optional[int], slots: Optional[int] = None
) -> torch.Tensor:
    """The additive ``[T, S]`` mask (0 or -inf) of queries at ``input_pos[0] + t`` over a
    cache of ``capacity`` positions, or over a ring buffer of ``slots`` rows, for a sliding
    ``window`` (None: causal only)."""
    start = input_pos[0].item()
    torch._check(start >= 0)
    queries = torch.arange(start, start + seq_len)
    if slots is None:
        allowed = attention_mask(queries, torch.arange(capacity), window)
    else:
        held = slot_positions(start + seq_len, slots)
        allowed = attention_mask(queries, held, window) & (held >= 0).unsqueeze(0)
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


class WindowMasks:
    """The attention masks over the whole cache of one model, computed once per forward:
    one per ``(window, ring rows)`` (window None: the causal mask of soft-capped layers;
    rows None: a cache as long as the context); and the rows each ring buffer length
    writes the new positions to.

    Every sliding layer of one window needs the same ``[T, S]`` mask. Computed in each
    layer, the program kept one per layer in its planned memory (the masks of all layers
    outlive the delegates placed between them), most of that memory in a long program
    (docs/performance.md, "Measurements behind the code"). A forward pre-hook on the
    model (:meth:`before_forward`) computes them from ``(tokens, input_pos)`` before the
    layers run, in the graph's prelude, like the RoPE tables; a cache takes its mask when it
    is handed the ``input_pos`` the hook saw, and computes its own otherwise (called on its
    own).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.windows: set[tuple[Optional[int], Optional[int]]] = set()
        self._input_pos: Optional[torch.Tensor] = None
        self._masks: dict[tuple[Optional[int], Optional[int]], torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}

    def before_forward(self, module, args, kwargs) -> None:
        tokens = args[0] if args else kwargs.get("tokens")
        input_pos = args[1] if len(args) > 1 else kwargs.get("input_pos")
        self.after_forward()
        if isinstance(tokens, torch.Tensor) and isinstance(input_pos, torch.Tensor):
            self._input_pos = input_pos
            self._masks = {
                key: window_mask(input_pos, tokens.shape[1], self.capacity, *key) for key in sorted(self.windows, key=str)
            }
            rings = sorted({slots for _, slots in self.windows if slots is not None})
            self._rows = {slots: ring_rows(input_pos, tokens.shape[1], slots) for slots in rings}

    def after_forward(self, *_) -> None:
        self._input_pos, self._masks, self._rows = None, {}, {}  # hold no tensors between calls

    def mask(
        self, input_pos: torch.Tensor, seq_len: int, window: Optional[int], slots: Optional[int] = None
    ) -> torch.Tensor:
        key = (window, slots)
        if input_pos is self._input_pos and key in self._masks:
            return self._masks[key]
        return window_mask(input_pos, seq_len, self.capacity, window, slots)

    def rows(self, input_pos: torch.Tensor, seq_len: int, slots: int) -> torch.Tensor:
        if input_pos is self._input_pos and slots in self._rows:
            return self._rows[slots]
        return ring_rows(input_pos, seq_len, slots)


# Set while the export computes its parity reference (llmcore.pipeline.parity).
_PLAIN_ATTENTION = contextvars.ContextVar("plain_attention", default=False)


@contextmanager
def plain_attention() -> Iterator[None]:
    """Within it, :class:`CustomOpKVAttention` attends in plain PyTorch (the cache, its mask,
    :func:`~llmcore.modules.explicit_attention`) instead of calling ``llama::custom_sdpa``.

    Why: the export's parity check needs an eager reference that is the same numbers in
    every process. ExecuTorch 1.5.1's eager ``custom_sdpa`` (the wheel's kernel for
    PyTorch) is not: on one thread two calls on the same inputs differ in the last bit
    (a 10-token prompt, 200 calls: three different outputs), and its results moved between
    processes on two threads; a quantized model's dynamic activation rounding turns such a
    bit into a different int8 level, so three exports of one gguf-layers program (identical
    bytes) read parity differences of 1.80, 2.35 and 2.51. With the attention written out
    they read 2.23 in three processes of three, on one thread or two alike (gguf: 2.62, three
    of three; its decode call is a near tie, see parity.NEAR_TIE_LOGITS).
    The cache is still written by ``llama::update_cache``, as the program writes it."""
    token = _PLAIN_ATTENTION.set(True)
    try:
        yield
    finally:
        _PLAIN_ATTENTION.reset(token)


def _capped_attention(q, keys, values, mask, scale, softcap) -> torch.Tensor:
    """Soft-capped attention of queries ``q [1, T, H, D]`` over cached ``keys``/``values``
    ``[1, S, H_kv, D]`` with a ``[T, S]`` mask; ``[1, T, H, D]``."""
    return explicit_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask, scale,
                              softcap).transpose(1, 2)


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
"""The buffer type of each :data:`llmcore.kv_cache.CACHE_DTYPES` name."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` as int8 with an fp32 scale and an int8 zero point per row of ``D``
    (``[..., 1]`` each): the asymmetric per-token rounding ``llama::custom_quantized_sdpa``
    reads back as ``(q - zero_point) * scale``. One ``llmcore::quantize_rows`` call where the
    runtime's library is built (:mod:`llmcore.builtins.runtime_attention`), the same
    arithmetic as ``quantized_decomposed``'s per-token ops, which a program otherwise calls."""
    if runtime_attention.kernel_built():
        runtime_attention.define()
        return torch.ops.llmcore.quantize_rows(x)
    register_quantized_ops()
    return runtime_attention.quantize_rows(x)


class _CachedAttention(nn.Module):
    """What both cached attentions below hold: the heads, the context, the window and its
    ring (``slots``: rows of a sliding layer's cache, None without a window), the scores'
    scale and soft cap, and the ``k_cache`` / ``v_cache`` buffers of ``cache_dtype``,
    ``batch`` dimensions ahead of [rows, kv heads, head dim] (an int8 cache's scales and zero
    points ahead of [rows, kv heads, 1])."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, capacity: int, window: Optional[int],
                 scale: Optional[float], softcap: Optional[float], slots: Optional[int], batch: tuple[int, ...],
                 cache_dtype: str = forms.DEFAULT_CACHE_DTYPE):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.capacity = capacity
        self.window = _window(window, capacity)
        self.slots = slots if self.window is not None else None
        self.scale, self.softcap = scale, softcap
        self.cache_dtype = cache_dtype
        dtype = TORCH_DTYPES[cache_dtype]
        shape = (*batch, self.slots or capacity, n_kv_heads, head_dim)
        self.register_buffer("k_cache", untouched_zeros(shape, dtype), persistent=False)
        self.register_buffer("v_cache", untouched_zeros(shape, dtype), persistent=False)
        if cache_dtype == "int8":
            for name in ("k", "v"):
                self.register_buffer(f"{name}_scales", untouched_zeros((*shape[:-1], 1)), persistent=False)
                self.register_buffer(f"{name}_zero_points", untouched_zeros((*shape[:-1], 1), torch.int8),
                                     persistent=False)

    @property
    def float_cache(self) -> bool:
        return self.cache_dtype == forms.DEFAULT_CACHE_DTYPE

    def stored(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the cache keeps of new keys or values ``x``: ``(x,)`` in the cache's float
        type, or ``(integers, scales, zero points)``."""
        if self.cache_dtype == "int8":
            return quantize_rows(x.float())
        return (x.to(self.k_cache.dtype),)

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache as fp32 keys and values (an int8 one read back as ``(q - zero
        point) * scale``)."""
        if self.cache_dtype == "int8":
            return tuple((cache.float() - zero_points.float()) * scales
                         for cache, scales, zero_points in map(self.buffers_of, ("k", "v")))
        return self.k_cache.float(), self.v_cache.float()

    def buffers_of(self, name: str) -> tuple[torch.Tensor, ...]:
        """The buffers ``stored`` values of ``name`` (``"k"``, ``"v"``) go to, in its order."""
        if self.cache_dtype == "int8":
            return getattr(self, f"{name}_cache"), getattr(self, f"{name}_scales"), getattr(self, f"{name}_zero_points")
        return (getattr(self, f"{name}_cache"),)


class CustomOpKVAttention(_CachedAttention):
    """Cached attention through ``llama::update_cache`` + ``llama::custom_sdpa``.

    With ``slots`` (a sliding layer's ring buffer), the cache has that many rows, position
    ``p`` is written to row ``p % slots`` by ``llama::update_cache_with_indices``, and the
    mask says which position each row holds (:func:`slot_positions`); ``custom_sdpa``
    ignores ``start_pos`` when it is given a mask."""

    def __init__(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        window: Optional[int] = None,
        masks: Optional[WindowMasks] = None,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        slots: Optional[int] = None,
        cache_dtype: str = forms.DEFAULT_CACHE_DTYPE,
    ):
        # [B, S, H, D]: the ops' layout
        super().__init__(n_heads, n_kv_heads, head_dim, capacity, window, scale, softcap, slots, batch=(1,),
                         cache_dtype=cache_dtype)
        self.masks = masks if masks is not None else WindowMasks(capacity)
        # soft caps through the runtime's kernel, or written out (module docstring)
        self.capped_kernel = softcap is not None and self.cache_dtype != "int8" and runtime_attention.kernel_built()
        if self.window is not None or (softcap is not None and not self.capped_kernel):
            self.masks.windows.add((self.window, self.slots))

    def forward(self, q, k, v, input_pos: Optional[torch.Tensor] = None):
        register_llama_ops()
        bsz, seq_len = q.shape[0], q.shape[1]
        start = _start(input_pos, seq_len, self.capacity)
        if self.slots is not None:
            torch._check(seq_len + self.window - 1 <= self.slots)  # the chunk fits beside the window
            rows = self.masks.rows(input_pos, seq_len, self.slots)
        for name, new in (("k", k), ("v", v)):
            for value, buffer in zip(self.stored(new), self.buffers_of(name)):
                if self.slots is None:
                    torch.ops.llama.update_cache(value, buffer, start)
                else:
                    torch.ops.llama.update_cache_with_indices(value, buffer, start, rows)
        if (self.softcap is not None and not self.capped_kernel) or _PLAIN_ATTENTION.get():
            # over the whole cache, masked: static shapes, which XNNPACK lowers (soft caps;
            # under plain_attention only the eager parity reference runs this)
            mask = self.masks.mask(input_pos, seq_len, self.window, self.slots)
            keys, values = (self.k_cache, self.v_cache) if self.float_cache else self.keys_values()
            y = _capped_attention(q, keys, values, mask, self.scale, self.softcap)
            return y.contiguous().view(bsz, -1, self.n_heads * self.head_dim).to(q.dtype)  # -1: a view XNNPACK takes
        # causal from start, or an explicit mask over the whole cache (the op then ignores
        # start and is_causal)
        mask = None if self.window is None else self.masks.mask(input_pos, seq_len, self.window, self.slots)
        causal = self.window is None
        if self.cache_dtype == "int8":
            q8, q_scales, q_zero_points = quantize_rows(q.float())
            y = torch.ops.llama.custom_quantized_sdpa(
                q8, self.k_cache, self.v_cache, start, mask, 0.0, causal, self.scale, q_zero_points, q_scales,
                self.k_zero_points, self.k_scales, self.v_zero_points, self.v_scales,
            )
        elif self.softcap is not None:
            runtime_attention.define()
            y = torch.ops.llmcore.softcap_sdpa(q.to(self.k_cache.dtype), self.k_cache, self.v_cache, start, mask,
                                               self.scale, self.softcap)
        else:
            scale = () if self.scale is None else (self.scale,)  # left out: the program as without one
            y = torch.ops.llama.custom_sdpa(q.to(self.k_cache.dtype), self.k_cache, self.v_cache, start, mask, 0.0,
                                            causal, *scale)
        return y.reshape(bsz, seq_len, self.n_heads * self.head_dim).to(q.dtype)


class StaticKVAttention(_CachedAttention):
    """Cached attention in plain PyTorch: ``index_put_`` writes, masked SDPA over the
    filled part of the cache (over the whole ring buffer of a sliding layer that has one,
    as :class:`CustomOpKVAttention`)."""

    def __init__(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        window: Optional[int] = None,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        slots: Optional[int] = None,
        cache_dtype: str = forms.DEFAULT_CACHE_DTYPE,
    ):
        # [S, H, D], batch of one: the written dimension comes first, which is the form
        # of in-place index_put the ExecuTorch runtime accepts.
        super().__init__(n_heads, n_kv_heads, head_dim, capacity, window, scale, softcap, slots, batch=(),
                         cache_dtype=cache_dtype)

    def forward(self, q, k, v, input_pos: Optional[torch.Tensor] = None):
        bsz, seq_len = q.shape[0], q.shape[1]
        start = _start(input_pos, seq_len, self.capacity)
        positions = torch.arange(seq_len) + start
        if self.slots is not None:
            torch._check(seq_len + self.window - 1 <= self.slots)  # the chunk fits beside the window
        rows = positions if self.slots is None else torch.remainder(positions, self.slots)
        self.k_cache[rows] = k[0].to(self.k_cache.dtype)  # aten.index_put_: re-inplaced by ExecuTorch
        self.v_cache[rows] = v[0].to(self.v_cache.dtype)
        if self.slots is None:
            end = start + seq_len
            keys = self.k_cache.narrow(0, 0, end).unsqueeze(0)  # [1, end, H, D]
            values = self.v_cache.narrow(0, 0, end).unsqueeze(0)
            mask = attention_mask(positions, torch.arange(end), self.window)  # [T, end]
        else:
            keys, values = self.k_cache.unsqueeze(0), self.v_cache.unsqueeze(0)
            held = slot_positions(start + seq_len, self.slots)
            mask = attention_mask(positions, held, self.window) & (held >= 0).unsqueeze(0)
        if self.softcap is not None:
            y = _capped_attention(q, keys.float(), values.float(), mask, self.scale, self.softcap)
            return y.reshape(bsz, seq_len, self.n_heads * self.head_dim).to(q.dtype)
        n_rep = self.n_heads // self.n_kv_heads
        keys, values = repeat_kv(keys.transpose(1, 2), n_rep), repeat_kv(values.transpose(1, 2), n_rep)
        y = F.scaled_dot_product_attention(q.transpose(1, 2).to(keys.dtype), keys, values, attn_mask=mask,
                                           scale=self.scale)
        return y.transpose(1, 2).reshape(bsz, seq_len, self.n_heads * self.head_dim).to(q.dtype)


@contextmanager
def caches_in_fp32(module: nn.Module) -> Iterator[None]:
    """Within it, every cached attention of ``module`` keeps fp32 keys and values (fresh
    buffers, filled page by page as written), whatever its ``cache_dtype``; the cache it had
    is back afterwards.

    Why: calibration records the float model's activations, and the channel-scale fold is
    checked by the float model's logits before and after. A rounded cache is not float
    arithmetic: an int8 cache's per-token scales do not commute with scaled channels, and
    the fold check saw that rounding move the logits (a tiny Llama, int8 cache: 0.0015,
    over the check's 0.001)."""
    swapped = []
    for m in module.modules():
        if isinstance(m, _CachedAttention) and not m.float_cache:
            kept = {name: getattr(m, name) for name, _ in m.named_buffers(recurse=False)}
            swapped.append((m, m.cache_dtype, kept))
            for name in [n for n in kept if n not in ("k_cache", "v_cache")]:
                delattr(m, name)
            m.cache_dtype = forms.DEFAULT_CACHE_DTYPE
            m.k_cache = untouched_zeros(kept["k_cache"].shape)
            m.v_cache = untouched_zeros(kept["v_cache"].shape)
    try:
        yield
    finally:
        for m, cache_dtype, kept in swapped:
            m.cache_dtype = cache_dtype
            for name, buffer in kept.items():
                if name in m._buffers:
                    setattr(m, name, buffer)
                else:
                    m.register_buffer(name, buffer, persistent=False)


def prefill_chunk(module: nn.Module, capacity: int) -> Optional[int]:
    """Tokens per call of a program whose sliding layers keep ring buffers: the shortest
    window shorter than the context (a chunk of up to ``W`` new positions beside the
    ``W - 1`` before it fits a ring of ``2W - 1`` rows), or None when no ring buffer would be
    shorter than the context, so that a call may take the whole context."""
    windows = [m.window for m in module.modules() if isinstance(m, CausalAttention) and m.window is not None]
    chunk = min((w for w in windows if w < capacity), default=None)
    if chunk is None or all(ring_slots(w, chunk, capacity) is None for w in windows):
        return None
    return chunk


def untouched_zeros(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros whose memory the system supplies page by page as it is first written (numpy's
    ``zeros`` is ``calloc``): a cache is resident only as far as a call has filled it. Filled
    with ``torch.zeros``, every cache was resident at once, beside the float weights at the
    export's peak. 16-bit types are allocated as int16 and viewed (numpy has no bfloat16)."""
    if dtype.itemsize == 2 and dtype.is_floating_point:
        return torch.from_numpy(np.zeros(shape, dtype=np.int16)).view(dtype)
    return torch.from_numpy(np.zeros(shape, dtype=torch.empty((), dtype=dtype).numpy().dtype))


@functools.cache
def register_llama_ops() -> None:
    """Import ExecuTorch's custom-ops module, which registers ``torch.ops.llama.*``. Done when
    a cached attention first runs (export, the parity reference), not when the transform is
    applied: the import is heavy in memory and time (docs/performance.md, "Measurements
    behind the code"), and at transform time it sat on top of the float weights that
    quantization frees next, raising the export's peak by as much."""
    importlib.import_module(CUSTOM_OPS_MODULE)


@functools.cache
def register_quantized_ops() -> None:
    """Register PyTorch's ``quantized_decomposed`` ops, which an int8 cache rounds its rows
    with, and their out variants (ExecuTorch's quantized kernels), which its program calls.
    Done when an int8 cache first rounds a row: no other cache needs them."""
    importlib.import_module(runtime_attention.QUANTIZED_DECOMPOSED_MODULE)
    importlib.import_module(QUANTIZED_KERNELS_MODULE)


def _apply(module: nn.Module, context: TransformContext, form: KVCacheForm) -> Transformed:
    cls = form.module_type()
    capacity = context.max_seq_len
    masks = WindowMasks(capacity)
    chunk = prefill_chunk(module, capacity)

    if context.kv_cache_dtype == "int8" and cls is not CustomOpKVAttention:
        raise LlmcoreError(
            f"--kv-cache-dtype int8 needs the {forms.CUSTOM_OPS.name} transform (llama::custom_quantized_sdpa); "
            f"{form.name} keeps fp32, bf16 or fp16.",
            stage="transform",
            fix=f"pass --kv-cache-dtype bf16 or fp16 with {form.name}, or drop --transforms {form.name}.",
        )

    def make(attn: CausalAttention) -> nn.Module:
        extra = {"scale": attn.scale, "softcap": attn.softcap, "slots": ring_slots(attn.window, chunk, capacity),
                 "cache_dtype": context.kv_cache_dtype}
        if cls is CustomOpKVAttention:
            return cls(attn.n_heads, attn.n_kv_heads, attn.head_dim, capacity, attn.window, masks, **extra)
        return cls(attn.n_heads, attn.n_kv_heads, attn.head_dim, capacity, attn.window, **extra)

    if replace_modules(module, CausalAttention, make) == 0:
        raise ValueError(
            "the model has no llmcore.modules.CausalAttention submodule to give a cache; "
            "its family must route attention through CausalAttention"
        )
    if masks.windows:  # sliding layers: their masks once per forward, before the layers
        module.register_forward_pre_hook(masks.before_forward, with_kwargs=True)
        module.register_forward_hook(masks.after_forward)
    convention = CallingConvention(
        use_kv_cache=True, use_sdpa_with_kv_cache="llama::custom_sdpa" in form.custom_ops, max_tokens_per_call=chunk
    )
    return Transformed(module, convention)


@hookimpl
def llmcore_source_transforms() -> list[SourceTransform]:
    return [
        SourceTransform(
            name=forms.CUSTOM_OPS.name,
            description=forms.CUSTOM_OPS.description,
            apply=lambda m, c: _apply(m, c, forms.CUSTOM_OPS),
            order=50,
            automatic=True,
        ),
        SourceTransform(
            name=forms.STATIC.name,
            description=forms.STATIC.description,
            apply=lambda m, c: _apply(m, c, forms.STATIC),
            order=50,
            replaces=(forms.CUSTOM_OPS.name,),
        ),
    ]
