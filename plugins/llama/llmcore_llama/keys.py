"""Every config key the llama plugin meets, and what it does with it.

The rule: **a key that changes the computation is implemented or refused by name, never
ignored.** A checkpoint whose config asks for something the model here does not compute
(YaRN RoPE, biases, soft-capping, ...) would otherwise export a program whose logits
differ from the original's, often by too little for a top-1 parity check to notice.

Each table below gives, per key, one of

* ``implemented``: read, and the model computes what it says;
* ``default-only``: implemented at the listed values (a bias switched off, one activation);
  any other value is refused;
* ``harmless``: does not change the logits of a forward pass in evaluation mode (ids,
  dtypes, training-only or generation-only settings, bookkeeping), with the reason.

A key in no table is refused unless its value is null (unset), so a new key that changes
the math cannot slip through; a harmless one is added to its table once checked.

Nothing here imports torch: the tables can be read, and configs checked, cheaply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional

from llmcore.errors import LlmcoreError

from .config import RopeScaling

PLUGIN = "llama"

IMPLEMENTED = "implemented"
DEFAULT_ONLY = "default-only"
HARMLESS = "harmless"


@dataclass(frozen=True)
class Key:
    status: str
    note: str
    allowed: tuple = ()
    """For ``default-only``: the values that are implemented."""


def _impl(note: str) -> Key:
    return Key(IMPLEMENTED, note)


def _only(note: str, *allowed: Any) -> Key:
    return Key(DEFAULT_ONLY, note, allowed)


def _harmless(note: str) -> Key:
    return Key(HARMLESS, note)


def refuse(message: str, fix: str, plugin: str = PLUGIN) -> LlmcoreError:
    return LlmcoreError(message, stage="load", plugin=plugin, fix=fix)


# --------------------------------------------------------------------------------------
# Hugging Face config.json (LlamaConfig, transformers 4.x and 5.x)
# --------------------------------------------------------------------------------------

_GENERATION = "a generation default (sampling, beams, lengths): not part of the forward pass"

HF_KEYS: dict[str, Key] = {
    # shapes and numerics
    "hidden_size": _impl("dim"),
    "num_hidden_layers": _impl("n_layers"),
    "num_attention_heads": _impl("n_heads"),
    "num_key_value_heads": _impl("n_kv_heads (null: n_heads)"),
    "intermediate_size": _impl("hidden_dim of the SwiGLU"),
    "vocab_size": _impl("vocab_size"),
    "head_dim": _impl("per-head width (null: hidden_size / num_attention_heads)"),
    "rms_norm_eps": _impl("norm_eps (default 1e-6, as transformers)"),
    "max_position_embeddings": _impl("max_seq_len; the bound of dynamic RoPE's no-op range"),
    "tie_word_embeddings": _impl("lm_head shares the embedding matrix"),
    # RoPE: both forms, see hf_rope()
    "rope_theta": _impl("RoPE base, legacy top-level form"),
    "rope_scaling": _impl("RoPE type and factors, legacy top-level form"),
    "rope_parameters": _impl("RoPE type, base and factors, transformers 5 form"),
    "partial_rotary_factor": _only("fraction of each head RoPE rotates: the whole head only", 1, None),
    # switches implemented at one value
    "hidden_act": _only("the SwiGLU activation", "silu", "swish"),
    "attention_bias": _impl("biases on the q/k/v/o projections"),
    "mlp_bias": _only("biases on gate/up/down projections", False, None),
    "rope_interleaved": _only("nanotron's flag: weights in HF's rotate-half layout", False, None),
    "pruned_heads": _only("attention heads removed after training", {}, None),
    "is_encoder_decoder": _only("an encoder-decoder model", False, None),
    "add_cross_attention": _only("cross-attention layers", False, None),
    "sliding_window": _only("sliding-window attention", None),
    "use_sliding_window": _only("sliding-window attention", False, None),
    "quantization_config": _only("weights quantized by a library (GPTQ, AWQ, bitsandbytes ...)", None),
    "auto_map": _only("custom modeling code shipped with the checkpoint", None),
    # architecture tags, checked by hf_config
    "model_type": _harmless("checked: must be llama"),
    "architectures": _harmless("checked: LlamaForCausalLM"),
    # harmless
    "pretraining_tp": _harmless("tensor-parallel slicing of the same matmuls in transformers < 4.40, ignored since"),
    "attention_dropout": _harmless("dropout: off at inference"),
    "hidden_dropout": _harmless("dropout: off at inference"),
    "initializer_range": _harmless("initialisation of untrained weights"),
    "use_cache": _harmless("KV-cache use at generation; the program's cache is llmcore's"),
    "bos_token_id": _harmless("token ids: the tokenizer files decide them"),
    "eos_token_id": _harmless("token ids: the tokenizer files decide them"),
    "pad_token_id": _harmless("the embedding's padding_idx only affects training gradients"),
    "sep_token_id": _harmless("token id"),
    "decoder_start_token_id": _harmless("token id"),
    "torch_dtype": _harmless("storage dtype: --dtype chooses the program's"),
    "dtype": _harmless("storage dtype: --dtype chooses the program's"),
    "use_bfloat16": _harmless("storage dtype"),
    "transformers_version": _harmless("bookkeeping"),
    "_name_or_path": _harmless("bookkeeping"),
    "_attn_implementation": _harmless("kernel choice (eager, sdpa, flash): same math"),
    "_attn_implementation_autoset": _harmless("kernel choice"),
    "is_llama_config": _harmless("nanotron bookkeeping"),
    "chunk_size_feed_forward": _harmless("computes the MLP in chunks: same math"),
    "output_attentions": _harmless("extra outputs only"),
    "output_hidden_states": _harmless("extra outputs only"),
    "return_dict": _harmless("output container"),
    "torchscript": _harmless("tracing mode"),
    "tie_encoder_decoder": _harmless("encoder-decoder only"),
    "cross_attention_hidden_size": _harmless("cross-attention only (refused through add_cross_attention)"),
    "is_decoder": _harmless("encoder-decoder bookkeeping"),
    "id2label": _harmless("classification heads: not used by a causal LM"),
    "label2id": _harmless("classification heads"),
    "num_labels": _harmless("classification heads"),
    "problem_type": _harmless("classification heads"),
    "finetuning_task": _harmless("bookkeeping"),
    "tokenizer_class": _harmless("tokenizer bookkeeping"),
    "prefix": _harmless("a text prefix for tasks"),
    "task_specific_params": _harmless("pipeline defaults"),
    "tf_legacy_loss": _harmless("training loss"),
    **{
        k: _harmless(_GENERATION)
        for k in (
            "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
            "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
            "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
            "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
            "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
            "suppress_tokens", "begin_suppress_tokens",
        )
    },
}

# RoPE types of transformers' rope_parameters / rope_scaling, and the keys each one reads.
ROPE_IMPLEMENTED = ("default", "linear", "llama3", "dynamic")  # dynamic: only within max_position_embeddings
_ROPE_KEYS = {
    "default": {"rope_type", "rope_theta", "partial_rotary_factor"},
    "linear": {"rope_type", "rope_theta", "partial_rotary_factor", "factor"},
    "dynamic": {"rope_type", "rope_theta", "partial_rotary_factor", "factor"},
    "llama3": {
        "rope_type", "rope_theta", "partial_rotary_factor", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings",
    },
    # for the families that implement it (RopeFeatures: Phi-3, Phi-4-mini)
    "longrope": {
        "rope_type", "rope_theta", "partial_rotary_factor", "short_factor", "long_factor", "factor",
        "attention_factor", "original_max_position_embeddings",
    },
}

LONGROPE = "longrope"
PARTIAL_ROTARY = "partial_rotary"


@dataclass(frozen=True)
class HFRope:
    """The RoPE a config.json asks for, in the decoder's terms (:class:`LlamaConfig` fields)."""

    theta: float
    scaling: Optional[RopeScaling] = None
    """Llama 3.1 frequency scaling."""
    linear: float = 1.0
    freq_factors: Optional[tuple[float, ...]] = None
    """Per-frequency divisors (LongRoPE's short factors)."""
    rotary_dim: Optional[int] = None
    """Channels per head that rotate (partial rotary); None: all."""
    attention_factor: float = 1.0
    """LongRoPE's factor on cos and sin."""

_ROPE_FIX = (
    "use a checkpoint with RoPE type default, linear or llama3 (or dynamic within max_position_embeddings), or a "
    "model family that implements this one (see `llmcore plugins`); deleting the key would give wrong outputs."
)


def check_keys(
    config: Mapping[str, Any], table: Mapping[str, Key], where: str, fix_unknown: str, plugin: str = PLUGIN
) -> None:
    """Refuse the first key of ``config`` that is not implemented at its value nor harmless.
    ``plugin`` is the family whose table this is (other families reuse these checks)."""
    for key, value in config.items():
        rule = table.get(key)
        if rule is None:
            if value is None:
                continue  # unset
            raise refuse(
                f"{where} key {key!r} = {_show(value)} is not one the {plugin} plugin knows: it may change the "
                "computation, so it is refused rather than ignored.",
                fix_unknown.format(key=key),
                plugin,
            )
        if rule.status == DEFAULT_ONLY and not any(_same(value, a) for a in rule.allowed):
            allowed = " or ".join(_show(a) for a in rule.allowed)
            raise refuse(
                f"{where} key {key!r} = {_show(value)} ({rule.note}) is not implemented by the {plugin} plugin "
                f"(it implements {allowed}).",
                "use a model family that implements it (see `llmcore plugins`), or a checkpoint without it.",
                plugin,
            )


def _same(value: Any, allowed: Any) -> bool:
    """``value`` is ``allowed`` (null only for null; 1 and 1.0 alike; a string never a number)."""
    if allowed is None:
        return value is None
    if isinstance(allowed, bool):
        return isinstance(value, (bool, int)) and not isinstance(value, float) and value == allowed
    if isinstance(allowed, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == allowed
    return type(value) is type(allowed) and value == allowed


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def hf_rope(
    cfg: Mapping[str, Any], max_seq_len: Optional[int] = None, plugin: str = PLUGIN, features: frozenset = frozenset()
) -> HFRope:
    """RoPE of a config.json in either form.

    The transformers 5 form nests everything in ``rope_parameters``; the legacy form has a
    top-level ``rope_theta`` and ``rope_scaling`` (whose ``type`` is the old name of
    ``rope_type``). A config may carry both; they must then agree. ``max_seq_len`` is the
    length the program is asked for (None: max_position_embeddings). ``features`` are what
    the calling family's transformers class computes beyond Llama's (:data:`LONGROPE`,
    :data:`PARTIAL_ROTARY`); without them those settings are refused.
    """
    params = cfg.get("rope_parameters")
    legacy = cfg.get("rope_scaling")
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    sources = [("rope_parameters", params), ("rope_scaling", legacy)]
    if cfg.get("rope_theta") is not None:
        sources.append(("", {"rope_theta": cfg["rope_theta"]}))
    for name, block in sources:
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise refuse(
                f"config.json key {name!r} holds {_show(block)}, not an object of RoPE parameters.",
                "check the config.json of the checkpoint.",
                plugin,
            )
        for key, value in block.items():
            if isinstance(value, Mapping):
                raise refuse(
                    f"config.json key '{name}.{key}' gives per-layer-type RoPE parameters, which the {plugin} "
                    "plugin does not implement.",
                    _ROPE_FIX,
                    plugin,
                )
            where = f"{name}.{key}" if name else key
            key = "rope_type" if key == "type" else key
            if key in merged and not _equal(merged[key], value):
                raise refuse(
                    f"config.json gives the RoPE parameter {key!r} twice with different values "
                    f"({origin[key]} = {_show(merged[key])}, {where} = {_show(value)}).",
                    "keep one of the two in config.json: the one the weights were trained with.",
                    plugin,
                )
            merged.setdefault(key, value)
            origin.setdefault(key, where)
    # Top-level keys transformers moves into the RoPE parameters: the rotated fraction
    # always, the original length only for LongRoPE (Phi3Config writes it for every type).
    tops = ["partial_rotary_factor"]
    if (merged.get("rope_type") or "default") == LONGROPE:
        tops.append("original_max_position_embeddings")
    for top in tops:
        if cfg.get(top) is not None:
            if top in merged and not _equal(merged[top], cfg[top]):
                raise refuse(
                    f"config.json gives {top!r} twice with different values ({origin[top]} = "
                    f"{_show(merged[top])}, {top} = {_show(cfg[top])}).",
                    "keep one of the two in config.json: the one the weights were trained with.",
                    plugin,
                )
            merged.setdefault(top, cfg[top])
            origin.setdefault(top, top)

    kind = merged.get("rope_type") or "default"
    if kind not in _ROPE_KEYS or (kind == LONGROPE and LONGROPE not in features):
        raise refuse(
            f"config.json key {origin.get('rope_type', 'rope_type')!r} = {_show(kind)}: RoPE type {kind!r} is not "
            f"implemented by the {plugin} plugin; ignoring it would silently change the logits.",
            _ROPE_FIX,
            plugin,
        )
    extra = sorted(set(merged) - _ROPE_KEYS[kind])
    if extra:
        key = extra[0]
        raise refuse(
            f"config.json key {origin[key]!r} = {_show(merged[key])} is not a parameter the {plugin} plugin "
            f"implements for RoPE type {kind!r} (it reads {', '.join(sorted(_ROPE_KEYS[kind]))}).",
            _ROPE_FIX,
            plugin,
        )

    def number(key: str, default: Optional[float] = None, positive: bool = True) -> float:
        value = merged.get(key, default)
        if value is None:
            raise refuse(
                f"config.json RoPE type {kind!r} needs {key!r}, which is missing.",
                "check the config.json of the checkpoint.",
                plugin,
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0
        ):
            raise refuse(
                f"config.json key {origin.get(key, key)!r} = {_show(value)} is not a positive number.",
                "check the config.json of the checkpoint.",
                plugin,
            )
        return float(value)

    theta = number("rope_theta", 10000.0)
    partial = merged.get("partial_rotary_factor")
    rotary_dim = None
    if partial is not None and not _same(partial, 1):
        if PARTIAL_ROTARY not in features:
            raise refuse(
                f"config.json key {origin['partial_rotary_factor']!r} = {_show(partial)}: partial rotary embeddings "
                f"(RoPE on part of each head) are not implemented by the {plugin} plugin.",
                _ROPE_FIX,
                plugin,
            )
        fraction = number("partial_rotary_factor")
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
        rotary_dim = int(head_dim * fraction)  # as transformers rounds it
        if fraction > 1 or rotary_dim < 2 or rotary_dim % 2:
            raise refuse(
                f"config.json key {origin['partial_rotary_factor']!r} = {_show(partial)} gives {rotary_dim} rotated "
                f"channels of a {head_dim}-wide head; RoPE needs an even number from 2 to the head width.",
                "check the config.json of the checkpoint.",
                plugin,
            )
    max_pos = cfg.get("max_position_embeddings", 2048)
    if kind == "linear":
        return HFRope(theta, linear=number("factor"), rotary_dim=rotary_dim)
    if kind == "llama3":
        scaling = RopeScaling(
            factor=number("factor"),
            low_freq_factor=number("low_freq_factor"),
            high_freq_factor=number("high_freq_factor"),
            # transformers 5 fills a missing one with max_position_embeddings
            original_max_position_embeddings=int(number("original_max_position_embeddings", max_pos)),
        )
        if scaling.high_freq_factor <= scaling.low_freq_factor:
            raise refuse(
                f"config.json llama3 RoPE has high_freq_factor {scaling.high_freq_factor} <= low_freq_factor "
                f"{scaling.low_freq_factor}.",
                "check the config.json of the checkpoint.",
                plugin,
            )
        return HFRope(theta, scaling=scaling, rotary_dim=rotary_dim)
    if kind == LONGROPE:
        return _longrope(merged, origin, number, theta, rotary_dim, cfg, max_seq_len, plugin)
    if kind == "dynamic":
        number("factor")
        wanted = max_seq_len or max_pos
        if wanted > max_pos:
            raise refuse(
                f"config.json key {origin['rope_type']!r} = 'dynamic': dynamic-NTK RoPE changes the frequencies "
                f"beyond max_position_embeddings ({max_pos}), and a {wanted}-position program would need that, "
                f"which the {plugin} plugin does not implement.",
                f"pass --max-seq-len {max_pos} or less (within it, dynamic RoPE is the default RoPE).",
                plugin,
            )
        return HFRope(theta, rotary_dim=rotary_dim)  # within max_position_embeddings: the unscaled frequencies
    return HFRope(theta, rotary_dim=rotary_dim)


def _longrope(merged, origin, number, theta, rotary_dim, cfg, max_seq_len, plugin) -> HFRope:
    """LongRoPE as transformers computes it (``_compute_longrope_parameters`` and the
    rotary embedding's update): inverse frequencies divided by ``short_factor`` while every
    position is below ``original_max_position_embeddings``, by ``long_factor`` once one is
    not, and cos/sin times an attention factor at all lengths. A program holds one table,
    so one no longer than the original length is implemented (short factors) and a longer
    one is refused: it would need the long factors from a length on, for the whole cache."""
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    pairs = (rotary_dim or head_dim) // 2
    for name in ("short_factor", "long_factor"):
        value = merged.get(name)
        if not isinstance(value, list) or len(value) != pairs or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in value
        ):
            raise refuse(
                f"config.json LongRoPE key {origin.get(name, name)!r} must list {pairs} positive numbers (one per "
                f"rotated channel pair), not {_show(value)}.",
                "check the config.json of the checkpoint.",
                plugin,
            )
    original = int(number("original_max_position_embeddings"))
    max_pos = int(cfg.get("max_position_embeddings") or original)
    factor = number("factor") if merged.get("factor") is not None else max_pos / original
    if merged.get("attention_factor") is not None:
        attention = number("attention_factor")
    else:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    wanted = max_seq_len or max_pos
    if wanted > original:
        raise refuse(
            f"config.json's LongRoPE switches to its long factors once a sequence passes "
            f"original_max_position_embeddings ({original}), and a {wanted}-position program would need that, "
            f"which the {plugin} plugin does not implement.",
            f"pass --max-seq-len {original} or less (within it, LongRoPE uses its short factors).",
            plugin,
        )
    return HFRope(theta, freq_factors=tuple(float(v) for v in merged["short_factor"]), rotary_dim=rotary_dim,
                  attention_factor=attention)


def sliding_window(value: Any, key: str = "sliding_window", plugin: str = PLUGIN) -> Optional[int]:
    """A config's sliding window (positions a query sees, itself included), checked: None
    when unset, else a positive integer."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise refuse(
            f"config.json key {key!r} = {_show(value)} is not a positive number of positions.",
            "check the config.json of the checkpoint.",
            plugin,
        )
    return value


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def _fix_unknown_in(file: str) -> str:
    """The fix for an unknown key of a JSON config file the user can edit."""
    return (
        f"if {{key!r}} does not change the model's outputs, delete it from {file} (and report it, so that it can "
        "be listed as harmless); otherwise use a model family that implements it (see `llmcore plugins`)."
    )


def check_hf(cfg: Mapping[str, Any], table: Mapping[str, Key] = HF_KEYS, plugin: str = PLUGIN) -> None:
    check_keys(cfg, table, "config.json", _fix_unknown_in("config.json"),
    plugin,
)


# --------------------------------------------------------------------------------------
# Meta params.json (Meta's llama reference code, llama-models, ExecuTorch's examples)
# --------------------------------------------------------------------------------------

META_KEYS: dict[str, Key] = {
    "dim": _impl("dim"),
    "n_layers": _impl("n_layers"),
    "n_heads": _impl("n_heads"),
    "n_kv_heads": _impl("n_kv_heads (null: n_heads)"),
    "vocab_size": _impl("vocab_size (-1: from the embedding)"),
    "hidden_dim": _impl("SwiGLU width (ExecuTorch); checked against the weights"),
    "multiple_of": _impl("SwiGLU width rounding (the weights' shape wins)"),
    "ffn_dim_multiplier": _impl("SwiGLU width multiplier (the weights' shape wins)"),
    "head_dim": _impl("per-head width"),
    "norm_eps": _impl("norm_eps"),
    "rope_theta": _impl("RoPE base"),
    "rope_freq_base": _impl("RoPE base, ExecuTorch's older name (rope_theta wins)"),
    "use_scaled_rope": _impl("Llama 3.1 RoPE scaling (original context 8192, low_freq_factor 1)"),
    "rope_scaling_factor": _impl("Llama 3.1 scaling factor (default 8)"),
    "rope_scale_factor": _impl("Llama 3.1 scaling factor, ExecuTorch's name"),
    "rope_high_freq_factor": _impl("Llama 3.1 high_freq_factor (default 4)"),
    "high_freq_factor": _impl("Llama 3.1 high_freq_factor, ExecuTorch's name"),
    "max_seq_len": _impl("max_seq_len"),
    "partial_rotary_factor": _only("fraction of each head RoPE rotates", 1, None),
    "use_hf_rope": _only("HF rotate-half RoPE layout", False, None),
    "attention_qkv_bias": _only("q/k/v biases", False, None),
    "output_bias": _only("a bias on the output layer", False, None),
    "use_qk_norm": _only("norms on q and k", False, None),
    "moe": _only("mixture of experts", False, None),
    "norm_type": _only("the norm", "rmsnorm", None),
    "act_fn": _only("the SwiGLU activation", "silu", None),
    "attention_type": _only("the attention", "mha", None),
    "embedding_scale_factor": _only("a scale on the embeddings", 1, None),
    "use_ffn_norm": _only("the norm before the MLP", True, None),
    "post_attention_norm": _only("an extra norm after attention", False, None),
    "post_ffn_norm": _only("an extra norm after the MLP", False, None),
    "rms_norm_add_unit_offset": _only("RMSNorm weights stored minus one", False, None),
    "apply_embedding": _only("the embedding inside the model", True, None),
    "apply_output": _only("the output layer inside the model", True, None),
    "quantization_args": _only("quantized weights", None),
    "lora_args": _only("LoRA adapters", None),
    "vision_chunk_size": _only("a vision encoder", None),
    "vision_max_num_chunks": _only("a vision encoder", None),
    "vision_num_cross_attention_layers": _only("a vision encoder", None),
    "max_batch_size": _harmless("the KV-cache batch of Meta's reference code"),
    "max_context_len": _harmless("the KV-cache size of ExecuTorch's examples"),
    "use_kv_cache": _harmless("an export option of ExecuTorch's examples"),
    "use_sdpa_with_kv_cache_op": _harmless("an export option of ExecuTorch's examples"),
    "enable_dynamic_shape": _harmless("an export option of ExecuTorch's examples"),
    "generate_full_logits": _harmless("an export option of ExecuTorch's examples"),
    "device": _harmless("placement"),
    "bos_idx": _harmless("token id"),
    "eos_idx": _harmless("token id"),
    "bos_count": _harmless("token count"),
    "eos_count": _harmless("token count"),
}

def check_meta(params: Mapping[str, Any]) -> None:
    check_keys(params, META_KEYS, "params.json", _fix_unknown_in("params.json"))


# --------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------
#
# llama.cpp reads a model's hyper-parameters from the keys under its architecture's name
# only (`llama.`, `qwen2.`, ...); `general.` keys are descriptive, `tokenizer.` keys are read
# by the tokenizer code, `split.` keys describe multi-file models (whose missing tensors are
# refused by name) and `quantize.` keys record how the file was quantized. So the
# architecture's keys are the ones checked; the decoder's architectures share one table.

GGUF_KEYS_BY_SUFFIX: dict[str, Key] = {
    "vocab_size": _impl("vocab_size"),
    "context_length": _impl("max_seq_len"),
    "embedding_length": _impl("dim"),
    "block_count": _impl("n_layers"),
    "feed_forward_length": _impl("hidden_dim"),
    "attention.head_count": _impl("n_heads"),
    "attention.head_count_kv": _impl("n_kv_heads (one value for all layers)"),
    "attention.layer_norm_rms_epsilon": _impl("norm_eps"),
    "attention.key_length": _impl("head_dim"),
    "attention.value_length": _impl("must equal the head width"),
    "rope.dimension_count": _impl("rotated width: must equal the head width"),
    "rope.freq_base": _impl("RoPE base"),
    "rope.scaling.type": _impl("none or linear; others refused"),
    "rope.scaling.factor": _impl("linear RoPE factor"),
    "rope.scale_linear": _impl("linear RoPE factor, older name"),
    "expert_count": _only("mixture of experts", 0),
    "expert_used_count": _only("mixture of experts", 0),
    "attention.causal": _only("causal attention", True),
    "rope.scaling.attn_factor": _only("a scale on attention (YaRN)", 1),
    "rope.scaling.original_context_length": _harmless("read by YaRN only (refused through rope.scaling.type)"),
    "rope.scaling.finetuned": _harmless("descriptive"),
}


def gguf_keys(arch: str, overrides: Mapping[str, Key] = MappingProxyType({})) -> dict[str, Key]:
    """The table for GGUF architecture ``arch``: its keys are ``{arch}.<suffix>``;
    ``overrides`` (by suffix) are a family's own rules over the decoder's."""
    return {f"{arch}.{suffix}": rule for suffix, rule in {**GGUF_KEYS_BY_SUFFIX, **overrides}.items()}


GGUF_KEYS = gguf_keys("llama")

GGUF_FIX_UNKNOWN = (
    "use a model family that implements {key!r} (see `llmcore plugins`), or a GGUF converted without it."
)


def check_gguf(
    fields: Mapping[str, Any], arch: str = "llama", plugin: str = PLUGIN,
    overrides: Mapping[str, Key] = MappingProxyType({}),
) -> None:
    """``fields``: GGUF key -> value; the keys under ``{arch}.`` are checked against the
    decoder's table with the family's ``overrides`` (by suffix) over it."""
    prefix = f"{arch}."
    check_keys(
        {k: v for k, v in fields.items() if k.startswith(prefix)}, gguf_keys(arch, overrides), "GGUF metadata",
        GGUF_FIX_UNKNOWN, plugin,
    )


def gguf_linear_factor(get, arch: str = "llama", plugin: str = PLUGIN) -> float:
    """The linear RoPE factor of a GGUF of architecture ``arch`` (``get(key)`` reads a
    metadata value).

    llama.cpp reads ``rope.scaling.factor`` (or the older ``rope.scale_linear``) whatever
    the scaling type and multiplies every position by its inverse; types other than none
    and linear (YaRN ...) add more, and are refused.
    """
    kind = get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise refuse(
            f"GGUF metadata key '{arch}.rope.scaling.type' = {_show(kind)}: RoPE scaling {kind!r} is not "
            f"implemented by the {plugin} plugin (it implements none and linear, and llama3 through "
            "rope_freqs.weight); ignoring it would silently change the logits.",
            "use a GGUF without that RoPE scaling, or a model family that implements it (see `llmcore plugins`).",
            plugin,
        )
    factor, key = get(f"{arch}.rope.scaling.factor"), f"{arch}.rope.scaling.factor"
    if factor is None:
        factor, key = get(f"{arch}.rope.scale_linear"), f"{arch}.rope.scale_linear"
    if factor is None:
        return 1.0
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 0:
        raise refuse(
            f"GGUF metadata key {key!r} = {_show(factor)} is not a positive number.",
            "convert the model again with llama.cpp's convert_hf_to_gguf.py.",
            plugin,
        )
    return float(factor) if factor else 1.0  # llama.cpp reads 0 as "no scaling"
