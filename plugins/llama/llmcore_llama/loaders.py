"""Checkpoint loaders: Meta, Hugging Face, GGUF and llama2.c -> :class:`LoadedModel`.

Every loader produces a state dict with Meta's parameter names and Meta's rotary layout
(interleaved channel pairs), then :func:`finish` builds the :class:`Transformer`, picks the
tokenizer and fills in :class:`ModelMetadata`.
"""

from __future__ import annotations

import logging
import math
import pickle
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Optional

import numpy as np
import torch

from llmcore import nesting
from llmcore.checkpoints import check_state_dict
from llmcore.errors import LlmcoreError
from llmcore.records import LoadedModel, LoadOptions, ModelMetadata, Tokenizer
from llmcore.runtime import torch_on_one_thread
from llmcore.stored import attach

from . import formats, keys, quants
from .config import LlamaConfig, RopeScaling, hidden_dim_from_meta_params
from .model import build_model, rope_tables
from .tokenization import TokenizerError, TokenizerInfo, find_tokenizer_near, load_tokenizer_file

log = logging.getLogger(__name__)

PLUGIN = "llama"

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


DEFAULT_FIX = (
    "check that the checkpoint is complete (compare its size with the source's) and holds a "
    "llama-architecture model (--debug shows details)."
)
FIT_FIX = "check that the config (config.json, params.json or the GGUF metadata) belongs to these weights and that no file is missing or cut short."


def load_error(message: str, fix: Optional[str] = None, plugin: str = PLUGIN) -> LlmcoreError:
    return LlmcoreError(message, stage="load", plugin=plugin, fix=fix or DEFAULT_FIX)


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise load_error(f"unknown dtype {name!r}.", fix=f"use one of: {', '.join(sorted(set(DTYPES)))}.") from None


# --------------------------------------------------------------------------------------
# Common tail
# --------------------------------------------------------------------------------------


def resolve_tokenizer(options: LoadOptions, default: Optional[Callable[[], Optional[TokenizerInfo]]] = None) -> Optional[TokenizerInfo]:
    """The user's `--tokenizer` if given, else what the checkpoint ships (or None)."""
    if options.tokenizer_path is not None:
        try:
            return load_tokenizer_file(Path(options.tokenizer_path))
        except TokenizerError as e:
            raise load_error(
                str(e),
                fix="pass --tokenizer a tokenizer.json, a SentencePiece .model or a tiktoken file.",
            ) from e
    if default is None:
        return None
    try:
        return default()
    except TokenizerError as e:
        raise load_error(str(e), fix="pass --tokenizer PATH to a tokenizer.json for this model.") from e


def finish(
    config: LlamaConfig,
    state_dict: dict,
    tokenizer: Optional[TokenizerInfo],
    options: LoadOptions,
    source: str,
    *,
    tokenizer_explicit: bool = True,
    file_name: Callable[[str], str] = lambda name: name,
    plugin: str = PLUGIN,
) -> LoadedModel:
    """``file_name`` maps a Meta parameter name to the name the checkpoint file uses, for
    errors about missing, extra or misshapen tensors; ``plugin`` is the family that loads
    (other families build on this decoder)."""
    try:
        config = config.with_max_seq_len(options.max_seq_len)
    except ValueError as e:
        raise load_error(f"{e}.", fix="pass a smaller --max-seq-len.", plugin=plugin) from None
    check_fit(config, state_dict, source, file_name, plugin)
    dtype = resolve_dtype(options.dtype)
    state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    try:
        model = build_model(config, state_dict)
    except (KeyError, RuntimeError, ValueError) as e:
        reason = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise load_error(f"the weights in {source} do not fit a {plugin} model: {reason}", fix=FIT_FIX, plugin=plugin) from e
    model.reset_buffers()  # keep RoPE tables in float32 whatever the dtype
    model.eval()

    if tokenizer is not None and tokenizer.size > config.vocab_size:
        message = (
            f"the tokenizer has {tokenizer.size} tokens but the model's vocabulary has "
            f"{config.vocab_size}: they do not belong together"
        )
        if tokenizer_explicit:
            raise load_error(message, fix="pass the tokenizer that ships with these weights.", plugin=plugin)
        log.warning("%s; ignoring the tokenizer found next to the checkpoint", message)
        tokenizer = None
    return loaded_model(model, config, tokenizer, family=plugin, source=source)


def loaded_model(model: torch.nn.Module, config: LlamaConfig, tokenizer: Optional[TokenizerInfo], *, family: str,
                 source: str) -> LoadedModel:
    """``model`` (of ``config``) as a loader hands it over: its metadata from the config and
    the tokenizer, which is in ``tokenizer.json`` form (None: the model has none)."""
    metadata = ModelMetadata(
        vocab_size=config.vocab_size,
        max_seq_len=config.max_seq_len,
        bos_id=tokenizer.bos_id if tokenizer else -1,
        eos_ids=tuple(tokenizer.eos_ids) if tokenizer else (),
        n_bos=tokenizer.n_bos if tokenizer else 0,
        chat_template=tokenizer.chat_template if tokenizer else None,
    )
    return LoadedModel(
        module=model,
        metadata=metadata,
        tokenizer=Tokenizer(json_text=tokenizer.json_text, description=tokenizer.description) if tokenizer else None,
        family=family,
        source=source,
    )


def check_fit(
    config: LlamaConfig, state_dict: dict, source: str, file_name: Callable[[str], str], plugin: str = PLUGIN
) -> None:
    """Missing, unexpected or misshapen tensors, named as the checkpoint names them."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build_model(config).state_dict().items() if not k.startswith("freqs")}
    if config.tie_embeddings:
        expected.pop("output.weight", None)
    given = {k: v for k, v in state_dict.items() if not (config.tie_embeddings and k == "output.weight")}
    c = config
    check_state_dict(
        expected,
        given,
        plugin=plugin,
        source=f"the weights in {source} do not fit a {plugin} model with dim={c.dim}, n_layers={c.n_layers}, "
        f"n_heads={c.n_heads}, n_kv_heads={c.n_kv_heads}, hidden_dim={c.hidden_dim}, vocab_size={c.vocab_size}",
        fix=FIT_FIX,
        file_name=file_name,
    )


def _check_file(path: Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise load_error(f"{path} does not exist.", fix="check the checkpoint path.")
    return path


# --------------------------------------------------------------------------------------
# Meta consolidated.*.pth + params.json
# --------------------------------------------------------------------------------------


def safe_torch_load(path: Path) -> dict:
    """``torch.load(weights_only=True)``: tensors and plain containers only.

    A pickle that references any other callable (``os.system``, ``builtins.exec`` ...) is
    rejected by torch's restricted unpickler before anything is called.
    """
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e).lower() and "zip" not in str(e).lower():
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) file
    except pickle.UnpicklingError as e:
        from llmcore.pickles import foreign_globals

        text = str(e)
        m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"Unsupported operand \d+", text)
        reason = f"it references {m.group(1)}" if m and m.groups() else (m.group(0) if m else "it is not plain tensors")
        calls = foreign_globals(path)
        if calls:
            reason = f"it references {', '.join(calls)}"
        raise load_error(
            f"refusing to load {path}: it is not a plain tensor checkpoint, its pickle asks to "
            f"run code or build arbitrary objects ({reason}). Nothing in it was executed.",
            fix="only load checkpoints from sources you trust; re-save the weights as a plain "
            "state dict (torch.save(model.state_dict())) or as safetensors.",
        ) from None
    except Exception as e:
        raise load_error(f"could not read {path} as a PyTorch checkpoint: {e}") from e
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        obj = obj["model"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise load_error(f"{path} does not hold a state dict of tensors.")
    return obj


def _merge_meta_shards(shards: list[dict], dim: int) -> dict:
    """Join model-parallel shards: column-parallel layers on dim 0, row-parallel on dim 1."""
    if len(shards) == 1:
        return shards[0]
    merged = {}
    for key, first in shards[0].items():
        parts = [s[key] for s in shards]
        if first.ndim < 2 or key.endswith("norm.weight"):
            merged[key] = first
        elif key.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            merged[key] = torch.cat(parts, dim=1)
        elif key == "tok_embeddings.weight":
            merged[key] = torch.cat(parts, dim=1 if first.shape[1] != dim else 0)
        else:
            merged[key] = torch.cat(parts, dim=0)
    return merged


def _clean_meta_keys(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("_orig_mod.").removeprefix("model.")
        if k in ("rope.freqs", "freqs_cis", "freqs_cos", "freqs_sin"):
            continue
        out[k] = v
    return out


def _one_of(params: dict, names: tuple[str, ...], default):
    """The value of whichever of ``names`` params.json sets (they must agree), else ``default``."""
    given = [(n, params[n]) for n in names if params.get(n) is not None]
    if any(float(v) != float(given[0][1]) for _, v in given[1:]):
        shown = ", ".join(f"{n} = {v!r}" for n, v in given)
        raise load_error(
            f"params.json gives one setting under several names with different values ({shown}).",
            fix="keep one of them in params.json: the one the weights were trained with.",
        )
    return given[0][1] if given else default


def meta_config(params: dict, sd: dict) -> LlamaConfig:
    """A :class:`LlamaConfig` from params.json: every key is implemented, harmless, or
    refused by name (``keys.META_KEYS``)."""
    keys.check_meta(params)
    dim = int(params["dim"])
    n_heads = int(params["n_heads"])
    vocab = int(params.get("vocab_size", -1))
    if vocab <= 0:
        vocab = int(sd["tok_embeddings.weight"].shape[0])
    if params.get("hidden_dim"):
        hidden = int(params["hidden_dim"])  # check_fit compares it with the weights
    elif "layers.0.feed_forward.w1.weight" in sd:
        hidden = int(sd["layers.0.feed_forward.w1.weight"].shape[0])
    else:
        hidden = hidden_dim_from_meta_params(dim, int(params.get("multiple_of", 256)), params.get("ffn_dim_multiplier"))
    # ExecuTorch's examples call the base rope_freq_base and use rope_theta over it when set
    theta = float(params["rope_theta"] if params.get("rope_theta") is not None else params.get("rope_freq_base", 10000.0))
    scaling = None
    if params.get("use_scaled_rope"):
        scaling = RopeScaling(
            factor=float(_one_of(params, ("rope_scaling_factor", "rope_scale_factor"), 8.0)),
            high_freq_factor=float(_one_of(params, ("rope_high_freq_factor", "high_freq_factor"), 4.0)),
        )
    head_dim = params.get("head_dim")
    max_seq_len = params.get("max_seq_len") or (8192 if theta >= 500000 else 4096)
    return LlamaConfig(
        dim=dim,
        n_layers=int(params["n_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(params.get("n_kv_heads") or n_heads),
        vocab_size=vocab,
        hidden_dim=hidden,
        norm_eps=float(params.get("norm_eps", 1e-5)),
        rope_theta=theta,
        max_seq_len=int(max_seq_len),
        tie_embeddings="output.weight" not in sd,
        head_dim=int(head_dim) if head_dim else None,
        rope_scaling=scaling,
    )


def load_meta(path: Path, options: LoadOptions) -> LoadedModel:
    path = _check_file(path)
    found = formats.meta_files(path)
    if found is None:
        raise load_error(
            f"{path} is not a Meta checkpoint (expected params.json next to consolidated.*.pth).",
            fix="point at the folder holding params.json and consolidated.00.pth.",
        )
    params_path, shard_paths = found
    try:
        params = nesting.loads(params_path.read_text(), what=str(params_path), plugin=PLUGIN)
    except LlmcoreError:
        raise
    except Exception as e:
        raise load_error(f"could not read {params_path}: {e}") from e
    if not isinstance(params, dict):
        raise load_error(f"{params_path} holds {type(params).__name__}, not an object of hyper-parameters.")
    keys.check_meta(params)  # before the weights are read
    shards = [_clean_meta_keys(safe_torch_load(p)) for p in shard_paths]
    sd = _merge_meta_shards(shards, int(params.get("dim", 0)))
    try:
        config = meta_config(params, sd)
    except (KeyError, ValueError, TypeError) as e:
        raise load_error(f"{params_path} does not describe a Llama model: {e}") from e
    folder = params_path.parent
    tok_path = find_tokenizer_near(folder)
    tok = resolve_tokenizer(options, (lambda: load_tokenizer_file(tok_path)) if tok_path else None)
    return finish(config, sd, tok, options, str(path), tokenizer_explicit=options.tokenizer_path is not None)


# --------------------------------------------------------------------------------------
# Hugging Face config.json + safetensors
# --------------------------------------------------------------------------------------

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.bias": "attention.wo.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_HF_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
# Meta names whose rows (or entries) follow the rotary channel order, and whose heads count:
# HF keeps each head's rotary halves apart, Meta interleaves them.
_ROTARY_ROWS = {"attention.wq": "n_heads", "attention.wk": "n_kv_heads"}
_ROTARY_HEAD_NORMS = ("attention.q_norm.weight", "attention.k_norm.weight")


def hf_layer_names() -> dict[str, str]:
    """Llama's Hugging Face layer tensor names -> the decoder's (a copy, for a family to extend)."""
    return dict(_HF_NAMES)


def hf_name(meta_name: str, layer_names: Optional[Mapping[str, str]] = None) -> str:
    """The Hugging Face name of a Meta parameter name (for messages)."""
    for hf, meta in _HF_TOP.items():
        if meta == meta_name:
            return hf
    parts = meta_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers":
        for hf, meta in (layer_names or _HF_NAMES).items():
            if meta == parts[2]:
                return f"model.layers.{parts[1]}.{hf}"
    return meta_name


def unpermute_hf_rotary(w: torch.Tensor, n_heads: int, rotary_dim: Optional[int] = None) -> torch.Tensor:
    """Undo HF's Q/K row permutation: HF keeps each head's rotary halves
    (``[x_0..x_{R/2-1}, y_0..y_{R/2-1}]``), Meta interleaves them (``x_0, y_0, x_1, ...``).
    ``w`` is a weight ``[out, in]`` or a bias ``[out]``; a per-head norm weight ``[D]`` is
    ``n_heads=1``. With partial rotary only the first ``rotary_dim`` rows of each head
    rotate; the rest keep their order."""
    return _rotary_rows(w, n_heads, rotary_dim, to_hf=False)


def permute_to_hf_rotary(w: torch.Tensor, n_heads: int, rotary_dim: Optional[int] = None) -> torch.Tensor:
    """Meta -> HF layout (the inverse of :func:`unpermute_hf_rotary`)."""
    return _rotary_rows(w, n_heads, rotary_dim, to_hf=True)


def _rotary_rows(w: torch.Tensor, n_heads: int, rotary_dim: Optional[int], to_hf: bool) -> torch.Tensor:
    head_dim = w.shape[0] // n_heads
    rot = rotary_dim or head_dim
    rest = tuple(w.shape[1:])
    heads = w.reshape(n_heads, head_dim, *rest)
    split = (n_heads, rot // 2, 2) if to_hf else (n_heads, 2, rot // 2)
    rotated = heads[:, :rot].reshape(*split, *rest).transpose(1, 2).reshape(n_heads, rot, *rest)
    if rot == head_dim:
        return rotated.reshape(w.shape)
    return torch.cat([rotated, heads[:, rot:]], dim=1).reshape(w.shape)


@dataclass(frozen=True)
class HFArchitecture:
    """What a family of this decoder reads from a Hugging Face ``config.json``.

    The llama plugin's is :data:`LLAMA_HF`; another family whose checkpoints are this
    decoder with switches on (biases, q/k norms: Qwen2, Qwen3) gives its own, so the keys
    check, the RoPE forms and the weight mapping stay in one place.
    """

    plugin: str
    """The family's plugin name: errors name it."""
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    keys: Mapping[str, keys.Key]
    """Every key the family meets (see :mod:`llmcore_llama.keys`)."""
    switches: Callable[[Mapping[str, Any], int], dict]
    """The :class:`LlamaConfig` switches (``qkv_bias``, ``o_bias``, ``qk_norm``) a config
    turns on, given the program's length; raises an :class:`LlmcoreError` for settings the
    decoder cannot compute at that length."""
    default_norm_eps: float = 1e-6
    rope_features: frozenset = frozenset()
    """RoPE forms the family's transformers class computes beyond Llama's
    (:data:`keys.LONGROPE`, :data:`keys.PARTIAL_ROTARY`)."""
    adapt: Optional[Callable[[dict, LlamaConfig], dict]] = None
    """Rewrites the family's tensors into what the decoder reads, before the layout is
    mapped: splits fused ones into Llama's Hugging Face names (Phi-3's ``qkv_proj``,
    ``gate_up_proj``), folds Gemma's ``1 + w`` norms. None: nothing to rewrite."""
    layer_names: Mapping[str, str] = field(default_factory=lambda: _HF_NAMES)
    """Hugging Face layer tensor names -> the decoder's (Meta's) names; Llama's by default.
    Gemma's four norms per layer name the same tensors differently."""
    rope_source: Optional[Callable[[Mapping[str, Any]], Mapping[str, Any]]] = None
    """The part of config.json the RoPE of the full-attention layers is read from, when not
    all of it (Gemma 3 nests per-layer-type parameters); None: the whole config."""

    def recognises(self, cfg: Mapping[str, Any]) -> bool:
        archs = cfg.get("architectures") or []
        return cfg.get("model_type") in self.model_types or any(a in self.architectures for a in archs)


def _llama_switches(cfg: Mapping[str, Any], max_seq_len: int) -> dict:
    bias = bool(cfg.get("attention_bias") or False)
    return {"qkv_bias": bias, "o_bias": bias}


LLAMA_HF = HFArchitecture(
    plugin=PLUGIN,
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    keys=keys.HF_KEYS,
    switches=_llama_switches,
)


def hf_config(cfg: dict, max_seq_len: Optional[int] = None, arch: HFArchitecture = LLAMA_HF) -> LlamaConfig:
    """A :class:`LlamaConfig` from a config.json. Every key is implemented, harmless, or
    refused by name (``arch.keys``); ``max_seq_len`` is the length asked for, which
    decides whether dynamic RoPE is a no-op."""
    if not arch.recognises(cfg):
        archs = cfg.get("architectures") or []
        raise load_error(
            f"this Hugging Face checkpoint is a {cfg.get('model_type') or archs or 'unknown'} model, not "
            f"{' or '.join(arch.model_types)}.",
            fix="pick the model family that matches the checkpoint's architecture (leave out --model and "
            "llmcore picks it).",
            plugin=arch.plugin,
        )
    keys.check_hf(cfg, arch.keys, arch.plugin)
    rope_cfg = cfg if arch.rope_source is None else arch.rope_source(cfg)
    rope = keys.hf_rope(rope_cfg, max_seq_len, arch.plugin, arch.rope_features)
    n_heads = int(cfg["num_attention_heads"])
    max_positions = int(cfg.get("max_position_embeddings") or 2048)
    return LlamaConfig(
        dim=int(cfg["hidden_size"]),
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        vocab_size=int(cfg["vocab_size"]),
        hidden_dim=int(cfg["intermediate_size"]),
        norm_eps=float(cfg["rms_norm_eps"]) if cfg.get("rms_norm_eps") is not None else arch.default_norm_eps,
        rope_theta=rope.theta,
        max_seq_len=max_positions,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        head_dim=int(cfg["head_dim"]) if cfg.get("head_dim") else None,
        rope_scaling=rope.scaling,
        rope_linear_factor=rope.linear,
        rope_freq_factors=rope.freq_factors,
        rotary_dim=rope.rotary_dim,
        rope_attention_factor=rope.attention_factor,
        **arch.switches(cfg, max_seq_len or max_positions),
    )


def hf_to_meta_state_dict(
    hf: dict, config: LlamaConfig, plugin: str = PLUGIN, layer_names: Optional[Mapping[str, str]] = None
) -> dict:
    names = _HF_NAMES if layer_names is None else layer_names
    sd = {}
    unknown = []
    for name, t in hf.items():
        if name in _HF_TOP:
            sd[_HF_TOP[name]] = t
            continue
        m = _HF_LAYER.match(name)
        if m and m.group(2) in names:
            new = names[m.group(2)]
            heads = _rotary_heads(new, config)
            # a misshapen tensor is left as it is, for check_fit to report
            if heads and t.dim() >= 1 and t.shape[0] == heads * config.resolved_head_dim:
                t = unpermute_hf_rotary(t, heads, config.rotary_dim)
            sd[f"layers.{m.group(1)}.{new}"] = t
        elif name.endswith("rotary_emb.inv_freq"):
            continue
        else:
            unknown.append(name)
    if unknown:
        raise load_error(
            f"unexpected tensors in the Hugging Face checkpoint: {', '.join(unknown[:5])}"
            + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""),
            fix=f"use the {plugin} family for checkpoints of its architectures only; " + FIT_FIX,
            plugin=plugin,
        )
    if config.tie_embeddings:
        sd.pop("output.weight", None)
    return sd


def load_hf(path: Path, options: LoadOptions, arch: HFArchitecture = LLAMA_HF) -> LoadedModel:
    plugin = arch.plugin
    path = _check_file(path)
    found = formats.hf_files(path)
    if found is None:
        raise load_error(
            f"{path} is not a Hugging Face checkpoint (expected config.json and *.safetensors).",
            fix="point at the model folder holding config.json and the weights.",
            plugin=plugin,
        )
    config_path, files = found
    try:
        cfg = nesting.loads(config_path.read_text(), what=str(config_path), plugin=plugin)
    except LlmcoreError:
        raise
    except Exception as e:
        raise load_error(
            f"could not read {config_path}: {e}", fix="check the config.json of the checkpoint.", plugin=plugin
        ) from e
    try:
        config = hf_config(cfg, options.max_seq_len, arch)
    except LlmcoreError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise load_error(
            f"{config_path} does not describe a {plugin} model: {type(e).__name__}: {e}",
            fix="check the config.json of the checkpoint (hidden_size, num_hidden_layers, num_attention_heads, "
            "intermediate_size, vocab_size).",
            plugin=plugin,
        ) from None
    from safetensors.torch import load_file

    # left in the file for a recipe that reads it layer by layer: shapes only, until then
    in_file = _safetensors_in_file(files, options, arch, plugin)
    hf: dict = {name: torch.empty(entry.shape, device="meta") for name, (_, entry) in in_file.items()}
    for f in files if not in_file else ():
        if f.suffix == ".bin":  # pytorch_model*.bin: a pickle, read with weights_only
            hf.update(safe_torch_load(f))
            continue
        try:
            hf.update(load_file(str(f)))
        except Exception as e:
            raise load_error(
                f"could not read {f} as safetensors: {e}",
                fix="download the file again: it is truncated or damaged (compare its size with the source's).",
                plugin=plugin,
            ) from e
    if arch.adapt is not None:
        hf = arch.adapt(hf, config)
    sd = hf_to_meta_state_dict(hf, config, plugin, arch.layer_names)
    stored = _hf_file_weights(in_file, config, sd, arch)
    folder = config_path.parent
    tok_path = find_tokenizer_near(folder)
    tok = resolve_tokenizer(options, (lambda: load_tokenizer_file(tok_path)) if tok_path else None)
    loaded = finish(
        config,
        sd,
        tok,
        options,
        str(path),
        tokenizer_explicit=options.tokenizer_path is not None,
        file_name=lambda name: hf_name(name, arch.layer_names),
        plugin=plugin,
    )
    if stored:
        loaded.stored_weights = stored
        attach(loaded.module, stored)  # a layer whose weight is still in the file refuses to run
    return loaded


def _safetensors_in_file(files: list[Path], options: LoadOptions, arch: HFArchitecture, plugin: str) -> dict:
    """For an export whose recipe reads weights in the file (``options.weights_in_file``):
    Hugging Face name -> ``(reader, entry)`` of every tensor of ``files`` (the 2-D ones stay in
    the file, :func:`_hf_file_weights` reads the rest). Empty (everything is read as before) for pickles, a family that rewrites tensors at load (``arch.adapt``:
    Phi-3's fused matrices, Gemma's norms) or a file holding other element types."""
    from .safetensors_rows import SafetensorsLayoutError, SafetensorsRows

    if not options.weights_in_file or arch.adapt is not None or any(f.suffix != ".safetensors" for f in files):
        return {}
    readers = []
    for f in files:
        try:
            readers.append(SafetensorsRows(f))
        except (SafetensorsLayoutError, OSError, KeyError, TypeError, ValueError) as e:
            raise load_error(
                f"could not read {f} as safetensors: {e}",
                fix="download the file again: it is truncated or damaged (compare its size with the source's).",
                plugin=plugin,
            ) from None
    if any(reader.other for reader in readers):
        return {}
    return {name: (reader, entry) for reader in readers for name, entry in reader.entries.items()}


def _hf_file_weights(in_file: dict, config: LlamaConfig, sd: dict, arch: HFArchitecture) -> dict:
    """The decoder's parameter name -> :class:`llmcore.stored.FileWeight` for the tensors
    :func:`_safetensors_in_file` left in the file; its 1-D tensors (norms, biases) are read
    into ``sd`` here. Rows of q/k weights are read in Meta's rotary order."""
    from llmcore.stored import FileWeight

    stored = {}
    hf_names = {hf_name(meta, arch.layer_names): meta for meta in sd}
    for name, (reader, entry) in in_file.items():
        meta = hf_names.get(name)
        if meta is None:  # e.g. lm_head of a tied model
            continue
        if len(entry.shape) != 2:
            sd[meta] = reader.read(name)
            heads = _rotary_heads(meta, config)
            if heads and sd[meta].shape[0] == heads * config.resolved_head_dim:
                sd[meta] = unpermute_hf_rotary(sd[meta], heads, config.rotary_dim)
            continue
        rows = entry.shape[0]
        heads = _rotary_heads(meta, config)
        order = None
        if heads and rows == heads * config.resolved_head_dim:
            order = unpermute_hf_rotary(torch.arange(rows), heads, config.rotary_dim)
        stored[meta] = FileWeight(format=entry.dtype, source_name=name, shape=tuple(entry.shape),
                                  read_floats=_rows_reader(reader, name, order))
    if stored:
        next(iter(stored.values())).read_floats(slice(0, 1))  # a damaged file fails at load
    return stored


def _rows_reader(reader, name: str, order: Optional[torch.Tensor]):
    def read_floats(selected: slice) -> torch.Tensor:
        if order is None:
            return reader.read(name, selected).float()
        wanted = order[selected]
        if not len(wanted):
            return reader.read(name, slice(0, 0)).float()
        low, high = int(wanted.min()), int(wanted.max()) + 1
        return reader.read(name, slice(low, high))[wanted - low].float()

    return read_floats


# --------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------

_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_GGUF_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_output.weight": "attention.wo.weight",
    # optional, as in llama.cpp: their presence turns the switch on (Qwen2 biases, Qwen3 norms)
    "attn_q.bias": "attention.wq.bias",
    "attn_k.bias": "attention.wk.bias",
    "attn_v.bias": "attention.wv.bias",
    "attn_output.bias": "attention.wo.bias",
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
}


def gguf_layer_names() -> dict[str, str]:
    """llama.cpp's GGUF layer tensor names -> the decoder's (a copy, for a family to extend)."""
    return dict(_GGUF_NAMES)


_GGUF_TOP = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}


FusedRows = Callable[[LlamaConfig], tuple[tuple[str, int], ...]]
"""For a fused GGUF matrix: the decoder tensors its rows hold, in order, and how many rows
each (Phi-3's ``attn_qkv``: q, k, v)."""


@dataclass(frozen=True)
class GGUFArchitecture:
    """What a family of this decoder reads from a GGUF file (the GGUF counterpart of
    :class:`HFArchitecture`).

    llama.cpp's converter stores a ``llama`` model's q/k rows in the interleaved rotary
    order this decoder uses (it permutes them), but Qwen2/Qwen3, Phi-3 and Gemma in Hugging
    Face's rotate-half order (llama.cpp runs those with its NEOX RoPE): ``rotate_half`` says
    the rows, q/k biases and per-head norms, integers included, are permuted at load.
    """

    plugin: str
    names: tuple[str, ...]
    """``general.architecture`` values the family reads; their keys are ``{name}.*``."""
    rotate_half: bool = False
    keys: Mapping[str, keys.Key] = field(default_factory=dict)
    """Metadata rules by suffix (``attention.sliding_window``) that the family adds to, or
    changes in, the decoder's table (:data:`keys.GGUF_KEYS_BY_SUFFIX`)."""
    switches: Optional[Callable[["GGUFView"], dict]] = None
    """The :class:`LlamaConfig` fields the family's metadata sets beyond the decoder's
    (soft-capping, sliding layers, LongRoPE factors); raises an :class:`LlmcoreError` for
    settings it cannot compute. None: none."""
    layer_names: Mapping[str, str] = field(default_factory=gguf_layer_names)
    """GGUF layer tensor names (``attn_q.weight``) -> the decoder's; llama.cpp's by default."""
    fused: Mapping[str, FusedRows] = field(default_factory=dict)
    """GGUF layer tensors that hold several of the decoder's matrices stacked by rows, split
    at load (integers included: a row keeps its blocks)."""
    metadata_tensors: tuple[str, ...] = ("rope_freqs.weight",)
    """Top-level tensors read as settings, not weights (RoPE frequency factors)."""
    partial_rotary: bool = False
    """``rope.dimension_count`` below the head width means RoPE on that many channels of each
    head (Phi-4-mini); without it such a file is refused."""


@dataclass(frozen=True)
class GGUFView:
    """A family's view of a GGUF's metadata while its config is built (for
    :attr:`GGUFArchitecture.switches`)."""

    file: "GGUFFile"
    arch: str
    """``general.architecture``: metadata keys are ``{arch}.<suffix>``."""
    tensors: Mapping[str, tuple]
    fields: Mapping[str, Any]
    """The :class:`LlamaConfig` fields read so far (``dim``, ``n_layers``, ``n_heads``,
    ``rope_theta``, ``max_seq_len`` ...)."""
    max_seq_len: Optional[int]
    """The program length asked for (``--max-seq-len``); None: the file's context length."""

    def get(self, suffix: str, default=None):
        value = self.file.get(f"{self.arch}.{suffix}")
        return default if value is None else value

    def require(self, suffix: str, kind=int):
        return self.file.require(f"{self.arch}.{suffix}", kind)

    def tensor(self, name: str) -> torch.Tensor:
        return _gguf_tensor(self.tensors[name], name)

    def refuse(self, message: str, fix: str) -> LlmcoreError:
        return load_error(f"{self.file.path}: {message}", fix=fix, plugin=self.file.plugin)


LLAMA_GGUF = GGUFArchitecture(PLUGIN, ("llama",))


class GGUFTensor(NamedTuple):
    """A tensor of a GGUF: what ``gguf.GGUFReader``'s tensors give, the same ``data`` view
    (``shape`` in the file's order, the row length first)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple
    n_elements: int
    n_bytes: int
    data_offset: int
    data: Any  # numpy array over the file's pages


# ggml types whose data are plain numbers (gguf.GGUFReader views them as such); the others
# are blocks of bytes
_GGUF_NUMBER_DTYPES = {"F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "I16": "int16",
                       "I32": "int32", "I64": "int64"}


class GGUFFile:
    """A GGUF's metadata and tensors, as ``gguf.GGUFReader`` gives them, from a header read
    by :func:`formats.read_gguf_header` (the reader itself spends over a second on a 49k-token
    vocabulary) and numpy views of the file's pages."""

    def __init__(self, path: Path, plugin: str = PLUGIN):
        self.plugin = plugin  # errors name the family reading the file
        try:
            import gguf
            from gguf.quants import quant_shape_to_byte_shape
        except ImportError as e:  # pragma: no cover
            raise self._error("reading GGUF files needs the gguf package.", fix="pip install gguf") from e
        block_sizes = {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
        try:
            header = formats.read_gguf_header(path, block_sizes)
        except formats.GGUFLayoutError as e:
            if e.truncated:
                raise self._error(
                    f"{path} is truncated: {e}.",
                    fix="download or copy it again (compare its size with the source's).",
                ) from None
            raise self._error(
                f"{path} is not a valid GGUF file: {e}.",
                fix="download it again, or convert the model with llama.cpp's convert_hf_to_gguf.py.",
            ) from None
        except OSError as e:
            raise self._error(f"could not read {path}: {e.strerror or e}.", fix="check the file's permissions.") from None
        self.path = path
        self.fields = header.fields
        # one mapping of the file; plain ndarray views of it (a memmap subclass per view
        # costs numpy a finalizer call each)
        self._memmap = np.memmap(path, mode="r")
        pages = self._memmap.view(np.ndarray)
        self.tensors = []
        for info in header.tensors:
            ggml_type = gguf.GGMLQuantizationType(info.ggml_type)
            per_block, block_bytes = block_sizes[info.ggml_type]
            n_elements = math.prod(info.dims)
            n_bytes = n_elements * block_bytes // per_block
            dims = tuple(reversed(info.dims))
            number = _GGUF_NUMBER_DTYPES.get(ggml_type.name)
            if number is None:
                dtype, dims = np.dtype(np.uint8), quant_shape_to_byte_shape(dims, ggml_type)
            else:
                dtype = np.dtype(number).newbyteorder(header.byte_order)
            data = pages[info.data_offset : info.data_offset + n_bytes].view(dtype).reshape(dims)
            self.tensors.append(GGUFTensor(info.name, ggml_type, info.dims, n_elements, n_bytes, info.data_offset, data))

    def _error(self, message: str, fix: str) -> LlmcoreError:
        return load_error(message, fix=fix, plugin=self.plugin)

    def get(self, key: str, default=None):
        """A key's value as ``gguf``'s ``ReaderField.contents()`` gives it (strings decoded)."""
        if key not in self.fields:
            return default
        try:
            return _decoded(self.fields[key])
        except UnicodeDecodeError as e:
            raise self._error(
                f"{self.path}: metadata field {key!r} is malformed ({type(e).__name__}: {e}).",
                fix="download the file again, or convert the model with llama.cpp's convert_hf_to_gguf.py.",
            ) from None

    def drop_pages(self, tensor, rows: Optional[tuple[int, int]] = None) -> None:
        """Let the kernel drop the file pages of a tensor already dequantized (``rows``: of
        its rows [first, stop) only): they count in the process's resident memory (the size
        of the file, on top of the float weights)."""
        import mmap

        mapping = getattr(self._memmap, "_mmap", None)
        if mapping is None or not hasattr(mapping, "madvise"):
            return
        page = mmap.PAGESIZE
        first, end = int(tensor.data_offset), int(tensor.data_offset) + int(tensor.n_bytes)
        if rows is not None:
            row_bytes = int(tensor.n_bytes) // int(tensor.data.shape[0])
            first, end = first + rows[0] * row_bytes, min(end, first + rows[1] * row_bytes)
        start = first // page * page
        try:
            mapping.madvise(mmap.MADV_DONTNEED, start, max(0, min(end, len(mapping)) - start))
        except (OSError, ValueError, AttributeError):
            pass

    def release_metadata(self) -> None:
        """Forget the key/values (the tensors stay readable)."""
        self.fields = {}

    def require(self, key: str, kind=int):
        """A metadata value the model cannot do without, as ``kind``; an error names the key."""
        value = self.get(key)
        if value is None:
            raise self._error(
                f"{self.path} lacks the metadata key {key!r} that the model needs.",
                fix="convert the model again with llama.cpp's convert_hf_to_gguf.py.",
            )
        try:
            if isinstance(value, (list, str, bytes)) and kind is not str:
                raise TypeError(type(value).__name__)
            return kind(value)
        except (TypeError, ValueError, OverflowError):
            raise self._error(
                f"{self.path}: metadata key {key!r} holds {str(value)[:40]!r}, not {'an integer' if kind is int else 'a number'}.",
                fix="convert the model again with llama.cpp's convert_hf_to_gguf.py.",
            ) from None


def _decoded(value):
    """A header value with its strings (``bytes``) decoded as UTF-8, strictly, as gguf does."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value


def gguf_config(
    g: GGUFFile, tensors: dict, arch: GGUFArchitecture = LLAMA_GGUF, max_seq_len: Optional[int] = None
) -> LlamaConfig:
    """A :class:`LlamaConfig` from a GGUF's metadata: every ``{arch}.`` key is implemented,
    harmless or refused by name (the decoder's table with ``arch.keys`` over it);
    ``max_seq_len`` is the program length asked for (LongRoPE depends on it)."""
    name, plugin = g.get("general.architecture"), arch.plugin
    if name not in arch.names:
        raise load_error(
            f"{g.path} holds a {name!r} model, not {' or '.join(arch.names)}.",
            fix="leave out --model so that llmcore picks the family from the GGUF's general.architecture, "
            "or pass the right one.",
            plugin=plugin,
        )

    def key(suffix: str) -> str:
        return f"{name}.{suffix}"

    experts = g.get(key("expert_count")) or 0
    if experts:
        raise load_error(
            f"{g.path} is a mixture-of-experts {name} ({experts} experts), which the {plugin} plugin does not support.",
            fix=f"use a dense {name} GGUF.",
            plugin=plugin,
        )
    dim = g.require(key("embedding_length"))
    n_heads = g.require(key("attention.head_count"))
    if isinstance(g.get(key("attention.head_count_kv")), list):
        raise load_error("per-layer KV head counts are not supported.", fix="use a GGUF with one KV head count.",
                         plugin=plugin)
    n_kv = g.require(key("attention.head_count_kv")) if g.get(key("attention.head_count_kv")) else n_heads
    # Every `{name}.` key is implemented, harmless or refused by name (keys.gguf_keys).
    keys.check_gguf({k: g.get(k) for k in g.fields}, name, plugin, arch.keys)
    head_dim = None
    # without attention.key_length, llama.cpp's head width is the rotated width, unless the
    # family rotates part of each head (then it is dim / heads)
    widths = (key("attention.key_length"),) + (() if arch.partial_rotary else (key("rope.dimension_count"),))
    for key_name in widths:
        if g.get(key_name):
            head_dim = g.require(key_name)
            break
    width = head_dim or (dim // n_heads if n_heads > 0 else 0)
    rotary_dim = None
    if arch.partial_rotary and g.get(key("rope.dimension_count")) is not None:
        rotary_dim = g.require(key("rope.dimension_count"))
        if rotary_dim == width:
            rotary_dim = None
        elif not (0 < rotary_dim < width and rotary_dim % 2 == 0):
            raise load_error(
                f"GGUF metadata key {key('rope.dimension_count')!r} = {rotary_dim} is not an even number of channels "
                f"within the head width {width}.",
                fix="convert the model again with llama.cpp's convert_hf_to_gguf.py.",
                plugin=plugin,
            )
    checked = ((key("attention.value_length"), "values narrower or wider than keys"),)
    if not arch.partial_rotary:
        checked = ((key("rope.dimension_count"), "RoPE on part of each head"),) + checked
    for key_name, what in checked:
        if g.get(key_name) is not None and g.require(key_name) != width:
            raise load_error(
                f"GGUF metadata key {key_name!r} = {g.get(key_name)} differs from the head width {width} ({what}), "
                f"which the {plugin} plugin does not implement.",
                fix="use a model family that implements it (see `llmcore plugins`).",
                plugin=plugin,
            )
    if head_dim is not None and n_heads > 0 and head_dim == dim // n_heads:
        head_dim = None
    linear = keys.gguf_linear_factor(g.get, name, plugin)
    if "token_embd.weight" not in tensors:
        raise load_error(
            f"{g.path} has no token_embd.weight tensor: it is not a complete {name} model.",
            fix="convert the model again with llama.cpp's convert_hf_to_gguf.py.",
            plugin=plugin,
        )
    emb = tensors["token_embd.weight"]
    vocab = g.require(key("vocab_size")) if g.get(key("vocab_size")) else int(emb[1][0] if emb[1] else 0)
    factors = None
    if "rope_freqs.weight" in tensors:
        factors = tuple(float(x) for x in _gguf_tensor(tensors["rope_freqs.weight"], "rope_freqs.weight").reshape(-1).tolist())
    fields = dict(
        dim=dim,
        n_layers=g.require(key("block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        vocab_size=vocab,
        hidden_dim=g.require(key("feed_forward_length")),
        norm_eps=g.require(key("attention.layer_norm_rms_epsilon"), float)
        if g.get(key("attention.layer_norm_rms_epsilon")) is not None
        else 1e-5,
        rope_theta=g.require(key("rope.freq_base"), float) if g.get(key("rope.freq_base")) is not None else 10000.0,
        max_seq_len=g.require(key("context_length")) if g.get(key("context_length")) is not None else 2048,
        tie_embeddings="output.weight" not in tensors,
        head_dim=head_dim or None,
        rotary_dim=rotary_dim,
        rope_freq_factors=factors,
        rope_linear_factor=linear,
        # optional tensors, as llama.cpp treats them: present in every layer or in none
        # (a layer without them is reported by check_fit)
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )
    if arch.switches is not None:
        fields.update(arch.switches(GGUFView(g, name, tensors, dict(fields), max_seq_len)))
    try:
        return LlamaConfig(**fields)
    except ValueError as e:
        raise load_error(f"{g.path}: {e}.", fix="convert the model again with llama.cpp's convert_hf_to_gguf.py.",
                         plugin=plugin) from None


def _gguf_tensor(entry, name: str) -> torch.Tensor:
    t, shape = entry
    try:
        return quants.dequantize(t.data, int(t.tensor_type), shape)
    except NotImplementedError:
        raise load_error(
            f"tensor {name!r} is stored as {quants.type_name(int(t.tensor_type))}, which the llama plugin "
            f"cannot dequantize (it reads {', '.join(quants.SUPPORTED)}, and what gguf.quants reads).",
            fix="use a GGUF quantized with supported types only (F16, Q8_0, Q4_0, Q4_1, Q4_K_M ...).",
        ) from None
    except (ValueError, RuntimeError) as e:  # the data does not hold the shape the header gives
        raise load_error(
            f"tensor {name!r} of shape {list(shape)} cannot be read from its {quants.type_name(int(t.tensor_type))} "
            f"data ({type(e).__name__}: {e}).",
            fix="download the file again: it is damaged.",
        ) from None


def load_gguf(path: Path, options: LoadOptions, arch: GGUFArchitecture = LLAMA_GGUF) -> LoadedModel:
    plugin = arch.plugin
    path = _check_file(path)
    if not formats.is_gguf(path):
        raise load_error(f"{path} is not a GGUF file (no GGUF magic).", plugin=plugin)
    t0 = time.perf_counter()
    g = GGUFFile(path, plugin)
    tensors = {}
    for t in g.tensors:
        shape = tuple(int(x) for x in reversed([int(d) for d in t.shape]))
        tensors[t.name] = (t, shape)
    config = gguf_config(g, tensors, arch, options.max_seq_len)
    names = {}  # GGUF name -> the decoder's name, or for a fused matrix the layer's prefix
    fused = {}  # GGUF name of a fused matrix -> its rows (GGUFArchitecture.fused)
    unknown = []
    for name in tensors:
        m = _GGUF_LAYER.match(name)
        if name in _GGUF_TOP:
            names[name] = _GGUF_TOP[name]
        elif m and m.group(2) in arch.fused:
            names[name], fused[name] = f"layers.{m.group(1)}.", arch.fused[m.group(2)]
        elif m and m.group(2) in arch.layer_names:
            names[name] = f"layers.{m.group(1)}.{arch.layer_names[m.group(2)]}"
        elif name not in arch.metadata_tensors:
            unknown.append(name)
    if unknown:
        raise load_error(
            f"{path} has tensors a {plugin} model does not use: {', '.join(unknown[:5])}",
            fix="use the model family that matches this GGUF (see `llmcore plugins`).",
            plugin=plugin,
        )
    tok = resolve_tokenizer(options, lambda: _gguf_tokenizer(g))
    if tok is not None and tok.chat_template is None and g.get("tokenizer.chat_template"):
        tok = replace(tok, chat_template=str(g.get("tokenizer.chat_template")))
    # The vocabulary and merges (98k strings on SmolLM2) are not needed any more: drop them
    # before the weights are dequantized.
    g.release_metadata()

    sd = {}
    stored = {}  # the quantized matrices left in the file (FileWeight), for a recipe that keeps their integers
    with torch_on_one_thread():  # small memory-bound ops
        for name, entry in tensors.items():
            if name not in names:
                continue
            t, shape = entry
            if options.stored_integers and len(shape) == 2 and int(t.tensor_type) not in quants.FLOAT_TYPES:
                # left in the file: the recipe that keeps its integers reads them
                for meta, form in _in_file(g, entry, name, fused.get(name), names[name], arch, config, plugin):
                    sd[meta] = torch.empty(form.shape, device="meta")
                    stored[meta] = form
                continue
            weight = _gguf_tensor(entry, name)
            if name in fused:
                pieces = _split_fused(name, weight, fused[name](config), names[name], plugin)
            else:
                pieces = [(names[name], weight)]
            for meta, weight in pieces:
                if arch.rotate_half:
                    heads = _rotary_heads(meta, config)
                    if heads and weight.shape[0] == heads * config.resolved_head_dim:
                        weight = unpermute_hf_rotary(weight, heads, config.rotary_dim)
                sd[meta] = weight
            g.drop_pages(t)
    log.info("GGUF %s read and dequantized in %.2fs", path, time.perf_counter() - t0)
    loaded = finish(config, sd, tok, options, str(path), file_name=lambda meta: gguf_name(meta, arch), plugin=plugin)
    loaded.stored_weights = stored
    attach(loaded.module, stored)  # a layer whose weight is still in the file refuses to run
    return loaded


def _in_file(g: GGUFFile, entry, name: str, parts, prefix: str, arch: GGUFArchitecture, config: LlamaConfig,
             plugin: str) -> list:
    """``[(decoder name, FileWeight)]`` of a quantized 2-D GGUF tensor (one, or the pieces of
    a fused matrix) read from the file only when a recipe asks (:class:`llmcore.stored.FileWeight`).

    A piece is a list of the file's rows: a fused matrix's part, in Meta's rotary order
    where the family's GGUF keeps Hugging Face's (:func:`unpermute_hf_rotary` applied to row
    numbers). Each read decodes those rows and gives their pages back. The first row is
    read here, so that a type nobody can decode or a damaged tensor fails at load."""
    t, shape = entry
    qtype, (rows, cols) = int(t.tensor_type), shape
    if parts is None:
        pieces = [(prefix, None)]
    else:
        sizes = [n for _, n in parts(config)]
        if sum(sizes) != rows:
            _split_fused(name, torch.empty(shape, device="meta"), parts(config), prefix, plugin)  # raises
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        pieces = [(prefix + suffix, torch.arange(a, a + n)) for (suffix, n), a in zip(parts(config), starts)]
    out = []
    for meta, order in pieces:
        heads = _rotary_heads(meta, config) if arch.rotate_half else None
        n = rows if order is None else len(order)
        if heads and n == heads * config.resolved_head_dim:
            order = unpermute_hf_rotary(torch.arange(rows) if order is None else order, heads, config.rotary_dim)
        out.append((meta, file_weight(g, t, qtype, name, cols, n, order)))
    out[0][1].read_floats(slice(0, 1))
    return out


def file_weight(g: GGUFFile, t, qtype: int, name: str, cols: int, rows: int, order: Optional[torch.Tensor] = None):
    """GGUF tensor ``t`` (``rows`` of ``cols``; ``order``: which of its rows, None for all) as a
    :class:`llmcore.stored.FileWeight`: its floats or integers read when a recipe asks. Public for
    families whose model is not this decoder (nanoGPT's GPT-2 GGUFs)."""
    from llmcore.stored import FileWeight

    def raw(selected: slice):
        return t.data[selected] if order is None else t.data[order[selected].numpy()]

    def read_floats(selected: slice) -> torch.Tensor:
        data = raw(selected)
        try:
            return _gguf_tensor((_Raw(data, qtype), (data.shape[0], cols)), name)
        finally:
            g.drop_pages(t)

    def read_integers():
        data = raw(slice(None))
        try:  # each slice's file pages dropped once decoded: a Q8_0 table is 321 MB at 1B
            form = quants.integer_weight(data, qtype, (rows, cols), name,
                                         decoded=(lambda a, b: g.drop_pages(t, (a, b))) if order is None else None)
        finally:
            g.drop_pages(t)
        return form if hasattr(form, "q") else None

    def read_blocks() -> torch.Tensor:
        data = raw(slice(None))
        try:
            block_bytes = quants.gguf.GGML_QUANT_SIZES[quants.Q(qtype)][1]
            return torch.from_numpy(np.array(data, dtype=np.uint8, copy=True).reshape(rows, -1, block_bytes))
        finally:
            g.drop_pages(t)

    return FileWeight(
        format=quants.type_name(qtype), source_name=name, shape=(rows, cols), read_floats=read_floats,
        read_integers=read_integers if qtype in quants.INTEGER_READERS else None,
        read_blocks=read_blocks if qtype in quants.KEPT_AS_STORED else None,
    )


class _Raw(NamedTuple):
    """Rows of a tensor's bytes in the form :func:`_gguf_tensor` reads (``.data``, ``.tensor_type``)."""

    data: Any
    tensor_type: int


def _split_fused(name: str, weight: torch.Tensor, parts, prefix: str, plugin: str) -> list:
    """``[(decoder name, rows)]`` of a fused GGUF matrix whose rows stack ``parts``
    (``[(decoder suffix, rows)]``)."""
    sizes = [rows for _, rows in parts]
    if weight.dim() != 2 or weight.shape[0] != sum(sizes):
        raise load_error(
            f"tensor {name!r} has shape {list(weight.shape)}, but the model's config stacks "
            f"{' + '.join(f'{rows} ({_module_of(suffix)})' for suffix, rows in parts)} rows in it.",
            fix="convert the model again with llama.cpp's convert_hf_to_gguf.py.",
            plugin=plugin,
        )
    return [(prefix + suffix, piece.contiguous()) for (suffix, _), piece in zip(parts, weight.split(sizes))]


def _module_of(suffix: str) -> str:
    return suffix.rsplit(".", 2)[-2]


def _rotary_heads(meta_name: str, config: LlamaConfig) -> Optional[int]:
    """How many heads' rotary halves the rows of ``meta_name`` hold (1 for a per-head q/k
    norm weight); None when its rows are not in rotary order."""
    if meta_name.endswith(_ROTARY_HEAD_NORMS):
        return 1
    module = re.sub(r"^layers\.\d+\.", "", meta_name).rpartition(".")[0]
    return getattr(config, _ROTARY_ROWS[module]) if module in _ROTARY_ROWS else None


def gguf_name(meta_name: str, arch: Optional[GGUFArchitecture] = None) -> str:
    """The GGUF name of a Meta parameter name (for messages)."""
    for name, meta in _GGUF_TOP.items():
        if meta == meta_name:
            return name
    layer_names = _GGUF_NAMES if arch is None else arch.layer_names
    parts = meta_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers":
        for name, meta in layer_names.items():
            if meta == parts[2]:
                return f"blk.{parts[1]}.{name}"
    return meta_name


def _gguf_tokenizer(g: GGUFFile) -> Optional[TokenizerInfo]:
    from .tokenization import tokenizer_from_gguf_fields

    if g.get("tokenizer.ggml.model") is None:
        return None
    return tokenizer_from_gguf_fields(g.get)


# --------------------------------------------------------------------------------------
# llama2.c
# --------------------------------------------------------------------------------------


def load_llama2c(path: Path, options: LoadOptions) -> LoadedModel:
    path = _check_file(path)
    h = formats.llama2c_header(path)
    if h is None:
        raise load_error(f"{path} is not a llama2.c checkpoint (header and file size do not agree).")
    if h["version"] not in (0, 1):
        raise load_error(
            f"{path} is a llama2.c export of version {h['version']}; only the legacy fp32 format "
            "and version 1 (fp32) are supported.",
            fix="re-export it with llama2.c's export.py --version 1 (or 0).",
        )
    dim, hidden, L = h["dim"], h["hidden_dim"], h["n_layers"]
    n_heads, n_kv, vocab, seq = h["n_heads"], h["n_kv_heads"], h["vocab_size"], h["max_seq_len"]
    head_dim = dim // n_heads
    kv_dim = n_kv * head_dim
    data = np.fromfile(path, dtype="<f4", offset=h["offset"])
    flat = torch.from_numpy(data)
    pos = 0

    def take(*shape: int) -> torch.Tensor:
        nonlocal pos
        n = int(np.prod(shape))
        out = flat[pos : pos + n].view(*shape)
        pos += n
        return out

    sd: dict = {}

    def per_layer(key: str, *shape: int) -> None:
        for i in range(L):
            sd[f"layers.{i}.{key}"] = take(*shape)

    if h["version"] == 0:
        sd["tok_embeddings.weight"] = take(vocab, dim)
        per_layer("attention_norm.weight", dim)
        per_layer("attention.wq.weight", dim, dim)
        per_layer("attention.wk.weight", kv_dim, dim)
        per_layer("attention.wv.weight", kv_dim, dim)
        per_layer("attention.wo.weight", dim, dim)
        per_layer("ffn_norm.weight", dim)
        per_layer("feed_forward.w1.weight", hidden, dim)
        per_layer("feed_forward.w2.weight", dim, hidden)
        per_layer("feed_forward.w3.weight", hidden, dim)
        sd["norm.weight"] = take(dim)
        stored_rope = (take(seq, head_dim // 2), take(seq, head_dim // 2))  # freqs_cos, freqs_sin
    else:
        per_layer("attention_norm.weight", dim)
        per_layer("ffn_norm.weight", dim)
        sd["norm.weight"] = take(dim)
        sd["tok_embeddings.weight"] = take(vocab, dim)
        per_layer("attention.wq.weight", dim, dim)
        per_layer("attention.wk.weight", kv_dim, dim)
        per_layer("attention.wv.weight", kv_dim, dim)
        per_layer("attention.wo.weight", dim, dim)
        per_layer("feed_forward.w1.weight", hidden, dim)
        per_layer("feed_forward.w2.weight", dim, hidden)
        per_layer("feed_forward.w3.weight", hidden, dim)
    if not h["shared_classifier"]:
        sd["output.weight"] = take(vocab, dim)
    assert pos == flat.numel(), (pos, flat.numel())

    # The header has no RoPE or norm settings: llama2.c's run.c computes RoPE with base
    # 10000 and RMSNorm with eps 1e-5, and so does this model.
    config = LlamaConfig(
        dim=dim,
        n_layers=L,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        vocab_size=vocab,
        hidden_dim=hidden,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=seq,
        tie_embeddings=h["shared_classifier"],
    )
    if h["version"] == 0:
        _check_llama2c_rope(path, config, *stored_rope)
    tok_path = find_tokenizer_near(path.parent)
    tok = resolve_tokenizer(options, (lambda: load_tokenizer_file(tok_path)) if tok_path else None)
    return finish(config, sd, tok, options, str(path), tokenizer_explicit=options.tokenizer_path is not None)


def _check_llama2c_rope(path: Path, config: LlamaConfig, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """A legacy llama2.c file stores the RoPE tables it was trained with: they must be the
    base-10000 ones this model computes (a model trained with other RoPE is refused)."""
    ours_cos, ours_sin = rope_tables(config)
    diff = max((cos - ours_cos[:, ::2]).abs().max().item(), (sin - ours_sin[:, ::2]).abs().max().item())
    if not diff <= 1e-3:  # float32 rounding of large angles stays far below
        raise load_error(
            f"{path}: the RoPE tables stored in this llama2.c checkpoint (freq_cis) are not the base-10000 ones "
            f"llama2.c computes (max difference {diff:.3g}): it was trained with other RoPE settings, which the "
            "legacy header cannot describe.",
            fix="export it from a format that states its RoPE settings (a Meta or Hugging Face checkpoint).",
        )


def write_llama2c(model, path: Path, *, version: int = 0) -> None:
    """Write a :class:`Transformer` as a llama2.c fp32 checkpoint (legacy or version 1)."""
    import struct

    c = model.config
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    shared = c.tie_embeddings
    L = c.n_layers

    def layers(key):
        return [sd[f"layers.{i}.{key}"] for i in range(L)]

    with open(path, "wb") as f:
        if version == 0:
            vocab = c.vocab_size if shared else -c.vocab_size
            f.write(struct.pack("<7i", c.dim, c.hidden_dim, L, c.n_heads, c.n_kv_heads, vocab, c.max_seq_len))
            order = [
                sd["tok_embeddings.weight"],
                *layers("attention_norm.weight"),
                *layers("attention.wq.weight"),
                *layers("attention.wk.weight"),
                *layers("attention.wv.weight"),
                *layers("attention.wo.weight"),
                *layers("ffn_norm.weight"),
                *layers("feed_forward.w1.weight"),
                *layers("feed_forward.w2.weight"),
                *layers("feed_forward.w3.weight"),
                sd["norm.weight"],
                model.freqs_cos[:, ::2].float(),  # the format keeps one value per pair
                model.freqs_sin[:, ::2].float(),
            ]
        elif version == 1:
            header = struct.pack("<Ii", formats.LLAMA2C_V1_MAGIC, 1)
            header += struct.pack("<7i", c.dim, c.hidden_dim, L, c.n_heads, c.n_kv_heads, c.vocab_size, c.max_seq_len)
            header += struct.pack("<B", int(shared))
            f.write(header + b"\0" * (256 - len(header)))
            order = [
                *layers("attention_norm.weight"),
                *layers("ffn_norm.weight"),
                sd["norm.weight"],
                sd["tok_embeddings.weight"],
                *layers("attention.wq.weight"),
                *layers("attention.wk.weight"),
                *layers("attention.wv.weight"),
                *layers("attention.wo.weight"),
                *layers("feed_forward.w1.weight"),
                *layers("feed_forward.w2.weight"),
                *layers("feed_forward.w3.weight"),
            ]
        else:
            raise ValueError(f"llama2.c version {version} is not supported")
        if not shared:
            order.append(sd["output.weight"])
        for t in order:
            f.write(t.numpy().astype("<f4").tobytes())
