"""The linear-layer recipes: which integers each ``nn.Linear`` gets, in :mod:`.qlinear`'s modules.

``8da4w`` (from float weights): int4 per block for every linear, the output layer at int8 per
channel unless ``output_bits=4`` (the logits are where 4 bits hurt most; llama.cpp keeps its
output layer at Q6_K or Q8_0 for the same reason). Symmetric blocks by default, each block's
scale chosen for the output error it causes on calibration text
(:func:`.qlinear.int4_blocks_activation_aware`; ``activation_aware=false``: HQQ's scales);
``asymmetric=true`` gives each block a minimum as well (Q4_1's form, fitted by least squares),
run like the ``gguf`` recipe's Q4_1 layers: less error, a slower decode (docs/quantization.md).

``8da8w`` (from float weights): every linear at int8 per output channel, the quality-first
recipe; with ``outlier_split`` (its default) the activations too lose almost nothing.

``gguf`` (from a quantized GGUF): each linear keeps the integers and scales the file stores
(:mod:`llmcore.stored`): Q4_0 as they are, Q4_1 and Q4_K as a symmetric int4 part plus the
per-block offset term. A matrix whose format no kernel here takes unchanged (Q8_0, whose
scales are per 32 where XNNPACK's int8 GEMM wants one per channel; Q5/Q6 types) is rounded to
int8 per channel from its exact values, and the export says so with the weight error it
measured. Nothing is changed silently. An embedding table stored as Q8_0 keeps its integers
too (:class:`.torchao_quant.StoredByteEmbedding`), a quarter of its fp32 size; tied to the
output layer and with ``tied_table`` (llmcore-kernels asks for it), that layer keeps them as
well (:class:`.qlinear.BlockInt8Linear`, the kernels' int8 blocks) and both read one table.
One stored as Q4_0, Q4_1 or Q4_K keeps its integers two a byte
(:class:`.torchao_quant.StoredNibbleEmbedding`). With ``q6_k_output`` (llmcore-kernels asks for
it) an output layer stored as Q6_K (a Q4_K_M file's) keeps the file's bytes
(:class:`.qlinear.StoredBlocksLinear`), and a token table tied to it looks its rows up in them
(:class:`.qlinear.StoredBlocksEmbedding`). With ``q4_k_headers`` (llmcore-kernels asks for it
too) a Q4_K linear keeps its super-blocks' headers beside its integers
(:attr:`.qlinear.BlockInt4Linear.q4_k_headers`): the kernels compute its exact scales and
offsets from them.

Both print one line per recipe run: what each group of layers became and the weight error
(``||W_program - W_source|| / ||W_source||``) it cost.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Optional

import torch
from torch import nn

from llmcore import channel_scales
from llmcore.errors import LlmcoreError
from llmcore.progress import WEIGHT_TEMPORARIES, before_own_mapping, heap_for_temporaries
from llmcore.records import Calibration
from llmcore.runtime import torch_threads_after_custom_ops
from llmcore.stored import (IntegerWeight, float_rows, floats, has_integers, in_file, pass_temporaries, record,
                            stored_blocks, stored_form)
from llmcore_xnnpack import qlinear
from llmcore_xnnpack.torchao_quant import (
    XNNPACK_GROUP_MULTIPLE,
    StoredByteEmbedding,
    StoredNibbleEmbedding,
    check_embedding_options,
    int8_row_table,
    check_options,
    linear_group,
    quantize_embeddings,
    shared_int8_table,
)

log = logging.getLogger(__name__)

OUTPUT_BITS = (4, 8)


def output_layer_names(module: nn.Module) -> set[str]:
    """The linear(s) that produce the logits: out-features equal to the vocabulary, i.e. the
    rows of the largest embedding table. Empty when the model has no embedding."""
    tables = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    if not tables:
        return set()
    vocab = max(tables)
    return {n for n, m in module.named_modules() if isinstance(m, nn.Linear) and m.out_features == vocab}


def _replace(module: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, attr, new)


def _linears(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in module.named_modules() if type(m) is nn.Linear]


def _linear_names(module: nn.Module) -> list[str]:
    """Names, not modules: a loop that replaces each linear then holds no reference to the
    ones it replaced, so each float weight is freed as soon as its integers exist (the export's
    peak memory is otherwise every float weight plus every quantized one)."""
    return [n for n, _ in _linears(module)]


class _Summary:
    """What each kind of layer became, with its weight error: one line at the end."""

    def __init__(self, recipe: str, options: dict):
        self.recipe = recipe
        self.outlier_split = options["outlier_split"]
        self.kinds: Counter = Counter()
        self.errors: dict[str, list[float]] = {}
        self.notes: list[str] = []

    def add(self, kind: str, approx=None, exact: Optional[torch.Tensor] = None,
            error: Optional[float] = None) -> Optional[float]:
        """One layer of ``kind``; with ``approx`` (the new layer, or its weight) and ``exact``
        (the weight it replaces), or the ``error`` already measured, its weight error, which
        is returned."""
        self.kinds[kind] += 1
        if approx is not None:
            error = qlinear.relative_error(approx, exact)
        if error is None:
            return None
        self.errors.setdefault(kind, []).append(error)
        return error

    def line(self) -> str:
        parts = []
        for kind, n in self.kinds.items():
            errs = self.errors.get(kind)
            err = f", weight error {100 * sum(errs) / len(errs):.3g}% (mean)" if errs else ""
            parts.append(f"{n} {kind}{err}")
        if self.outlier_split:
            parts.append("activations: int8 per token with outliers on a second row")
        parts += self.notes
        return f"{self.recipe}: " + "; ".join(parts)


def _int8_layer(linear: nn.Linear, exact: torch.Tensor, outlier_split: bool,
                energy: Optional[torch.Tensor] = None,
                error: Optional[qlinear.ErrorSum] = None) -> qlinear.ChannelInt8Linear:
    """int8 per channel: min/max scales (their error added to ``error`` as the rows are read),
    or with ``energy`` (the input's mean squares on calibration text) the scales of least
    output error."""
    if energy is None:
        q, scales = qlinear.int8_channels(exact, error)
    else:
        q, scales = qlinear.int8_channels_activation_aware(exact, energy)
    return qlinear.ChannelInt8Linear(q, scales, linear.bias, outlier_split)


def _calibrate(recipe: str, module: nn.Module, names: list[str], options: dict, calibration: Optional[Calibration],
               calibrated: bool, why_not: str,
               search: Optional[channel_scales.ScaleSearch] = None) -> tuple[dict, str]:
    """The input energies of the named linears (name -> mean squares) when ``calibrated``, and
    a note for the summary line; ``({}, "")`` otherwise. A channel-scale ``search`` reads the
    same pass. ``why_not`` names the option that turned calibration off, for the message
    refusing a ``calibration_text`` nothing reads."""
    if options["calibration_text"] and not calibrated:
        raise LlmcoreError(
            f"{recipe}: calibration_text is read only for activation-aware and channel scales, and this export "
            f"sets {why_not}.",
            fix=f"drop calibration_text, or drop {why_not}.",
        )
    if not calibrated:
        return {}, ""
    if calibration is None:
        raise LlmcoreError(
            f"{recipe}: activation_aware scales need calibration text run through the model, and none was given.",
            fix=f"call quantize_{recipe} with the pipeline's Calibration, or set {why_not}.",
        )
    energies, tokens = input_energy(module, names, calibration, options["calibration_text"], recipe, search)
    return energies, f", {tokens} calibration tokens"


def input_energy(module: nn.Module, names: list[str], calibration: Calibration, text: str,
                 recipe: str, search: Optional[channel_scales.ScaleSearch] = None) -> tuple[dict, int]:
    """The mean square of every input feature of the named linears over a calibration text
    (``text``: a path, or empty for llmcore's built-in text), and the number of tokens the
    model read. Recorded by forward pre-hooks while the float model reads the text once;
    a channel-scale ``search`` is handed the inputs it asks for in the same pass."""
    sums: dict[str, torch.Tensor] = {}
    counts: Counter = Counter()
    searched = set(search.inputs) if search is not None else set()
    summed = set(names)

    def recorder(name: str):
        def record(_, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            if name in summed:
                sums[name] = sums[name] + x.square().sum(0) if name in sums else x.square().sum(0)
                counts[name] += x.shape[0]
            if name in searched:
                search.record(name, x)
        return record

    hooks = [module.get_submodule(n).register_forward_pre_hook(recorder(n)) for n in summed | searched]
    try:
        fed = calibration.run(module, calibration.token_ids(text))
    finally:
        for hook in hooks:
            hook.remove()
    missing = [n for n in names if n not in sums]
    if missing:  # e.g. experts no calibration token was routed to: weight-only scales for them
        log.warning(
            "%s: the calibration text never reached %d linear layer(s) (%s%s): they keep weight-only scales",
            recipe, len(missing), ", ".join(missing[:3]), ", ..." if len(missing) > 3 else "",
        )
    return {n: sums[n] / counts[n] for n in sums}, fed


def _int4_block(linear: nn.Linear, group_size: int) -> Optional[int]:
    """The int4 block ``8da4w`` gives ``linear``'s in-features (the whole row for group 0), or
    None when XNNPACK's int4 GEMM cannot take them and the layer stays fp32."""
    group = linear_group(linear.in_features, group_size)
    return None if group is None else (group or linear.in_features)


def _channel_scale_search(module: nn.Module, options: dict, bits: int) -> Optional[channel_scales.ScaleSearch]:
    """The search for the channel scales ``module`` lists (None if it lists none), scored with
    the recipe's rounding in its cheap form (min/max's grid: int4 per block for ``bits=4``,
    int8 per channel for 8; the activation-aware scales chosen afterwards do better still)
    and the activations as the GEMM rounds them."""
    groups = channel_scales.scalable_channels(module)
    if not groups:
        return None

    def round_weight(name: str, w: torch.Tensor) -> torch.Tensor:
        if bits == 8:
            q, scales = qlinear.int8_channels(w)
            return q.float() * scales.unsqueeze(1)
        block = _int4_block(module.get_submodule(name), options["group_size"])
        return w if block is None else qlinear.int4_rounded(w, block)  # None: stays fp32

    return channel_scales.ScaleSearch(
        module, groups, round_weight, lambda x: qlinear.gemm_input(x, options["outlier_split"]))


def _fold(module: nn.Module, search: Optional[channel_scales.ScaleSearch], energies: dict,
          calibration: Calibration, options: dict) -> str:
    """Fold the searched channel scales; the recorded input energies of the layers they scaled
    are divided accordingly (those layers now read ``x / s``). Returns the summary's note."""
    if search is None:
        return f"no channel scales ({type(module).__name__} lists no scalable channels)"
    folded = search.fold(calibration, options["calibration_text"])
    for name, columns in folded.columns.items():
        if name in energies:
            energies[name] = energies[name] / columns.square()
    return folded.summary()


def quantize_8da4w(module: nn.Module, options: dict, calibration: Optional[Calibration] = None) -> nn.Module:
    """``8da4w``: int4 linears (int8 output layer by default), optional int8/int4 embeddings."""
    check_options(options)
    if options["output_bits"] not in OUTPUT_BITS:
        raise LlmcoreError(
            f"8da4w: output_bits {options['output_bits']} is not supported.",
            fix="use output_bits=8 (the default) or 4.",
        )
    outputs = output_layer_names(module)  # before embeddings are replaced
    calibrated = (options["activation_aware"] or options["awq"]) and not options["asymmetric"]
    why_not = "asymmetric=true" if options["asymmetric"] else "activation_aware=false and awq=false"
    # The int8 output layer keeps min/max scales: activation-aware ones hardly moved SmolLM2's
    # mean KL, not worth the search over its 28M weights (docs/quantization.md,
    # "Activation-aware scales by default").
    int4 = [n for n in _linear_names(module) if not (n in outputs and options["output_bits"] == 8)]
    aware = int4 if options["activation_aware"] else []  # the layers whose input energies are recorded
    search = _channel_scale_search(module, options, 4) if calibrated and options["awq"] else None
    energies, calibration_note = _calibrate("8da4w", module, aware, options, calibration, calibrated, why_not, search)
    summary = _Summary("8da4w", options)
    # the searches after the calibration, which ran ExecuTorch's custom ops: on one thread
    # unless the runtime workers' OpenMP keeps to one (llmcore.runtime.torch_threads_after_custom_ops)
    with torch_threads_after_custom_ops():
        if calibrated and options["awq"]:
            summary.notes.append(_fold(module, search, energies, calibration, options))
        kept = []
        tied_int8 = {}  # id of an output layer's weight -> its int8 layer, for a table tied to it
        # one layer's floats at a time (read from the checkpoint file if the loader left it
        # there); their temporaries reuse the heap's pages from layer to layer, in one scope
        # over the loop: a scope for each layer gave them back, and every layer faulted them
        # in again (docs/performance.md, "Measurements behind the code")
        with heap_for_temporaries(largest=pass_temporaries(module, WEIGHT_TEMPORARIES)):
            for name in _linear_names(module):
                linear = module.get_submodule(name)
                if name in outputs and options["output_bits"] == 8:  # read a few rows at a time
                    before_own_mapping(linear.weight.numel())  # its int8 table: the heap's free pages go first
                    rounding = qlinear.ErrorSum()
                    new = _int8_layer(linear, float_rows(linear.weight), options["outlier_split"], error=rounding)
                    tied_int8[id(linear.weight)] = new
                    summary.add("output layer int8 per channel", error=rounding.relative)
                    _replace(module, name, new)
                    continue
                block = _int4_block(linear, options["group_size"])
                if block is None:
                    kept.append(name)
                    continue
                w = floats(linear.weight)
                rounding = None
                if options["asymmetric"]:
                    q, scales, offsets = qlinear.int4_blocks_affine(w, block)
                    kind = "asymmetric int4"
                elif name in energies:
                    rounding = qlinear.ErrorSum()
                    q, scales = qlinear.int4_blocks_activation_aware(w, block, energies.pop(name), rounding)
                    offsets, kind = None, f"int4 (activation-aware scales{calibration_note})"
                else:
                    q, scales = qlinear.int4_blocks(w, block, options["hqq"])
                    offsets, kind = None, "int4" + (" (HQQ scales)" if options["hqq"] else "")
                new = qlinear.BlockInt4Linear(q, scales, offsets, linear.bias, options["outlier_split"],
                                              nibbles=options["int4_nibbles"])
                q = None
                if rounding is not None:
                    summary.add(f"linears {kind} (block {new.block})", error=rounding.relative)
                else:
                    summary.add(f"linears {kind} (block {new.block})", new, w)
                w = None
                _replace(module, name, new)
        if options["embedding_bits"]:  # last: its int8 copy is not held beside every float linear
            _, shared = quantize_embeddings(module, options["embedding_bits"], options["embedding_group_size"],
                                            "hqq_scale_only" if options["hqq"] else "affine",
                                            tied_int8 if options["tied_table"] else None)
            if shared:
                summary.notes.append("the tied embedding looks its rows up in the output layer's int8 ones (one table)")
    if kept:
        log.warning(
            "8da4w: %d linear layer(s) kept in fp32, their in-features not being a multiple of %d: %s",
            len(kept), XNNPACK_GROUP_MULTIPLE, ", ".join(kept),
        )
    log.warning("%s", summary.line())
    return module


def quantize_8da8w(module: nn.Module, options: dict, calibration: Optional[Calibration] = None) -> nn.Module:
    """``8da8w``: every linear int8 per output channel (XNNPACK's qc8w GEMM), optional
    int8/int4 embeddings."""
    check_embedding_options(options, "8da8w")
    calibrated = options["activation_aware"] or options["awq"]
    search = _channel_scale_search(module, options, 8) if options["awq"] else None
    energies, calibration_note = _calibrate(
        "8da8w", module, _linear_names(module) if options["activation_aware"] else [], options, calibration,
        calibrated, "activation_aware=false and awq=false", search)
    summary = _Summary("8da8w", options)
    with torch_threads_after_custom_ops():  # as in quantize_8da4w
        summary.notes += [_fold(module, search, energies, calibration, options)] if options["awq"] else []
        if options["embedding_bits"]:
            quantize_embeddings(module, options["embedding_bits"], options["embedding_group_size"])
        # one layer's floats at a time (read from the file if the loader left them there), their
        # temporaries on the heap's pages from layer to layer (as in quantize_8da4w's loop)
        with heap_for_temporaries(largest=pass_temporaries(module, WEIGHT_TEMPORARIES)):
            for name in _linear_names(module):
                linear = module.get_submodule(name)
                before_own_mapping(linear.weight.numel())  # an int8 output layer as large: free pages go first
                w = floats(linear.weight)
                energy = energies.pop(name, None)
                new = _int8_layer(linear, w, options["outlier_split"], energy)
                scales = f" (activation-aware scales{calibration_note})" if energy is not None else ""
                summary.add(f"linears int8 per channel{scales}", new, w)
                w = None
                _replace(module, name, new)
    log.warning("%s", summary.line())
    return module


def nibble_table(form, padding_idx: Optional[int]) -> Optional[StoredNibbleEmbedding]:
    """A 4-bit GGUF table's lookup on its own integers, or None for another kind of weight, or
    offsets no zero point holds (:class:`.torchao_quant.StoredNibbleEmbedding`)."""
    if not (isinstance(form, IntegerWeight) and form.bits == 4):
        return None
    try:
        return StoredNibbleEmbedding(form.q, form.scales, form.offsets, padding_idx)
    except ValueError as e:  # rounded to int8 rows instead, which the caller reports
        log.info("gguf: %s: %s; its table becomes int8 rows", form.source_name, e)
        return None


def quantize_gguf(module: nn.Module, options: dict) -> nn.Module:
    """``gguf``: every linear from the integers its GGUF stores (see the module docstring).

    One layer at a time: a weight the loader left in the file (:class:`llmcore.stored.FileWeight`)
    is read here once, its integers for a layer that keeps them (whose weight error, the bf16
    scales', follows from those integers) or its floats a few rows at a time for one rounded
    afresh (the error summed as the rows go by), so the export never holds the model's
    weights as floats."""
    names = _linear_names(module)
    if not any(has_integers(record(module.get_submodule(name).weight)) for name in names):
        raise LlmcoreError(
            "gguf: the checkpoint stores no quantized matrices (the recipe carries a quantized GGUF's own "
            "integers into the program).",
            fix="export a quantized GGUF (Q4_0, Q4_1, Q4_K_M, Q8_0 ...), or use --quantize 8da4w for float weights.",
        )
    summary = _Summary("gguf", options)
    scale_rounding = 0.0
    rounded_int8 = {}  # id of a weight rounded to int8 per channel -> its layer (a tied table's)
    kept_int8_blocks = {}  # id of a tied table's weight kept as Q8_0 blocks -> the output layer holding them
    kept_as_stored = {}  # id of an output layer's weight kept as the file's Q6_K -> that layer
    outputs = output_layer_names(module)
    tables = {id(m.weight) for m in module.modules() if type(m) is nn.Embedding}
    rounded_again = {}  # format -> [(weight, its error)] of the weights rounded to int8 per channel
    for name in names:
        # one weight's reads and roundings: their temporaries reuse heap pages, which go back
        # once the layer is made (llmcore.progress.heap_for_temporaries)
        with heap_for_temporaries(largest=WEIGHT_TEMPORARIES):
            linear = module.get_submodule(name)
            form = stored_form(linear.weight)
            if isinstance(form, IntegerWeight) and form.bits == 4:
                headers = form.headers if options["q4_k_headers"] and options["int4_nibbles"] else None
                new = qlinear.BlockInt4Linear(form.q, form.scales, form.offsets, linear.bias, options["outlier_split"],
                                              nibbles=options["int4_nibbles"], q4_k_headers=headers)
                if headers is not None:  # the file's values exactly, where the kernels take the layer
                    summary.add(f"{form.format} kept with its headers (the kernels compute the file's values)")
                else:
                    bf16 = form.scales.to(torch.bfloat16).float()
                    scale_rounding = max(scale_rounding, qlinear.bf16_scale_error(form.scales, bf16))
                    kept_offsets = qlinear.float16_offsets(form.offsets, form.block)
                    summary.add(f"{form.format} kept", error=qlinear.rescaled_error(form.q, form.scales, bf16,
                                                                                    form.offsets, kept_offsets))
            elif (isinstance(form, IntegerWeight) and form.bits == 8 and form.offsets is None
                  and form.block == qlinear.BlockInt8Linear.block and options["tied_table"]
                  and id(linear.weight) in tables and qlinear.float16_values(form.scales)):
                # a tied Q8_0 table (SmolLM2's, Gemma-3-1B's: widths no multiple of Q6_K's 256):
                # the output layer reads its blocks as they are, and the lookups the same
                # tensors below. Rounded to int8 per channel, it was a second table (Gemma-3-1B's
                # program 1.45x its file) and 1.17% weight error (SmolLM2's)
                new = qlinear.BlockInt8Linear(form.q, form.scales.half(), linear.bias)  # Q8_0's own fp16
                kept_int8_blocks[id(linear.weight)] = new
                summary.add(f"{form.format} kept (tied: one table)")
            elif (options["q6_k_output"] and name in outputs and form is not None and form.format == "Q6_K"
                  and linear.in_features % qlinear.Q6_K_VALUES == 0
                  and (blocks := stored_blocks(linear.weight)) is not None):
                # the file's Q6_K super-blocks as they are (llmcore-kernels asks for them): 6.56 bits a
                # weight and the file's values, where int8 per channel took 8 and rounded them again
                stored = record(linear.weight)
                new = qlinear.StoredBlocksLinear(form.format, blocks, stored.read_floats, stored.shape, linear.bias)
                kept_as_stored[id(linear.weight)] = new
                summary.add(f"{form.format} kept (output layer)" +
                            (" (tied: one table)" if id(linear.weight) in tables else ""))
            elif form is not None:
                rounding = qlinear.ErrorSum()
                new = _int8_layer(linear, float_rows(linear.weight), options["outlier_split"], error=rounding)
                rounded_int8[id(linear.weight)] = new
                error = summary.add(f"{form.format} -> int8 per channel", error=rounding.relative)
                rounded_again.setdefault(form.format, []).append((form.source_name, error))
            else:  # stored as floats in the file, or rebuilt by a transform: kept as floats
                summary.add("float kept")
                continue
            form = None
            _replace(module, name, new)
    for name, table in [(n, m) for n, m in module.named_modules() if type(m) is nn.Embedding]:
        recorded = record(table.weight)
        if table.max_norm is not None or recorded is None:
            continue
        with heap_for_temporaries(largest=WEIGHT_TEMPORARIES):
            if id(table.weight) in kept_as_stored:  # the output layer's Q6_K, the same tensor
                _replace(module, name, qlinear.StoredBlocksEmbedding(kept_as_stored[id(table.weight)], table.padding_idx))
                summary.add("embedding Q6_K -> the output layer's Q6_K (tied: one table)")
                continue
            if id(table.weight) in kept_int8_blocks:  # the output layer's Q8_0 blocks, the same tensors
                kept = kept_int8_blocks[id(table.weight)]
                _replace(module, name, StoredByteEmbedding(kept.q, kept.scales, table.padding_idx))
                summary.add("embedding Q8_0 -> the output layer's int8 blocks (tied: one table)")
                continue
            form = stored_form(table.weight) if has_integers(recorded) else recorded
            lookup = nibble_table(form, table.padding_idx)
            if lookup is not None:
                # Q4_0, Q4_1, Q4_K (an untied model's token table; Q4_K_M's): its integers two a
                # byte, half the bytes of int8 rows (Llama-3.1-8B's Q4_0 table: 295 MB in the
                # file, 591 MB as rows)
                _replace(module, name, lookup)
                summary.add(f"embedding {form.format} kept (4-bit rows)")
            elif isinstance(form, IntegerWeight) and form.offsets is None:  # Q8_0: its integers, as int8 rows
                # kept even when tied to an int8 output layer (tied_table): that layer rounded the
                # table again (one scale a row), and SmolLM2's Q8_0 table looked up from those rows
                # cost perplexity +1.83% against +1.27% (KL 0.01855 against 0.01827) for the 32 MB
                # (23%) a second table takes (2026-12-04, `llmcore eval` on alice-chapter1.txt)
                _replace(module, name, StoredByteEmbedding(form.q, form.scales, table.padding_idx))
                summary.add(f"embedding {form.format} kept")
            elif options["tied_table"] and id(table.weight) in rounded_int8:  # tied to an int8 output layer
                _replace(module, name, shared_int8_table(rounded_int8[id(table.weight)], table.padding_idx))
                summary.add(f"embedding {form.format} -> the output layer's int8 rows (tied: one table)")
            elif in_file(table.weight):  # a form no lookup takes as stored (Q6_K, Q5_0 ...): Q8_0's, from its floats
                rounding = qlinear.ErrorSum()
                new = int8_row_table(float_rows(table.weight), table.padding_idx, error=rounding)
                _replace(module, name, new)
                summary.add(f"embedding {form.format} -> int8 rows of {XNNPACK_GROUP_MULTIPLE}",
                            error=rounding.relative)
            form = None
    for format_name, weights in rounded_again.items():  # one line a format, not one a weight (a Q8_0 file's 113)
        worst_name, worst = max(weights, key=lambda w: w[1])
        what, error = ((f"{worst_name} ({format_name}) is", f"{100 * worst:.3g}%") if len(weights) == 1 else
                       (f"{len(weights)} {format_name} weights are", f"at most {100 * worst:.3g}% ({worst_name})"))
        log.warning("gguf: %s rounded again, to int8 per channel (no kernel here takes %s as stored): weight error %s",
                    what, format_name, error)
    line = summary.line()
    if scale_rounding:
        line += f"; 4-bit scales fp16 -> bf16 (XNNPACK's scale type): at most {100 * scale_rounding:.3g}% per scale"
    log.warning("%s", line)
    return module
