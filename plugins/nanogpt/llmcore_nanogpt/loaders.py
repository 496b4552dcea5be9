"""Checkpoint formats the nanoGPT family reads.

* nanoGPT's own ``ckpt.pt`` from ``train.py``: ``model_args`` plus a state dict whose keys
  may carry ``_orig_mod.`` (left by ``torch.compile``).
* Hugging Face GPT-2: ``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``;
  HF's ``Conv1D`` stores weights as ``[in, out]``, the transpose of ``nn.Linear``.

Pickles load with ``torch.load(weights_only=True)``: a checkpoint that tries to run code
is refused, and the code never runs.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Optional

import torch

from llmcore import nesting
from llmcore.checkpoints import check_state_dict
from llmcore.errors import LlmcoreError
from llmcore.modules import LayerNorm
from llmcore.records import LoadedModel, LoadOptions, Tokenizer

from llmcore_nanogpt.model import GPT, GPTConfig

PLUGIN = "nanogpt"
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers that GPT-2 implementations keep for the causal mask; this model builds none.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def _error(message: str, fix: str) -> LlmcoreError:
    return LlmcoreError(message, stage="load", plugin=PLUGIN, fix=fix)


def load_pickle(path: Path) -> Any:
    """``torch.load`` restricted to tensors and plain containers."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except pickle.UnpicklingError as exc:
        from llmcore.pickles import foreign_globals

        calls = foreign_globals(path)
        reason = f"it asks to call {', '.join(calls)}" if calls else _unpickling_reason(exc)
        raise _error(
            f"refused to load {str(path)!r}: its pickle holds more than tensors and plain data ({reason}); "
            "nothing in it was executed.",
            "load only checkpoints you trust, re-saved as plain state dicts or safetensors.",
        ) from None
    except (EOFError, RuntimeError, OSError, ValueError) as exc:
        reason = " ".join(str(exc).split()).split(". ")[0][:160]  # torch appends paragraphs of advice
        raise _error(
            f"{str(path)!r} is truncated or not a PyTorch checkpoint ({type(exc).__name__}: {reason}).",
            "check the file, or save it again.",
        ) from None


def _unpickling_reason(exc: Exception) -> str:
    """The line of torch's long weights-only message that says what was refused."""
    lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
    for line in lines:
        if line.startswith(("Unsupported", "Trying to", "Can only")):
            return line[:160]
    return (lines[0] if lines else type(exc).__name__)[:160]


def build_model(config: GPTConfig, state: dict[str, torch.Tensor], source: str) -> GPT:
    """A GPT with ``state`` loaded; missing, extra or misshapen tensors are named in the error."""
    with torch.device("meta"):
        model = GPT(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = {k: v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}
    state.setdefault("lm_head.weight", state.get("transformer.wte.weight"))
    if state["lm_head.weight"] is None:
        state.pop("lm_head.weight")
    check_state_dict(
        expected,
        state,
        plugin=PLUGIN,
        source=f"checkpoint {source!r} does not fit a GPT-2 with n_layer={config.n_layer}, "
        f"n_head={config.n_head}, n_embd={config.n_embd}, vocab_size={config.vocab_size}",
        fix="check that its config matches its weights and that the file is complete.",
    )
    model = GPT(config)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.eval()


# ---- nanoGPT ckpt.pt ------------------------------------------------------------------------


def _ckpt_file(path: Path) -> Optional[Path]:
    if path.is_dir():
        return path / "ckpt.pt" if (path / "ckpt.pt").is_file() else None
    return path if path.suffix in (".pt", ".pth", ".ckpt") else None


def matches_nanogpt(path: Path) -> bool:
    return _ckpt_file(path) is not None


def read_nanogpt(path: Path) -> tuple[GPT, Optional[str], Path]:
    """The model of a nanoGPT ``ckpt.pt``, the dataset it was trained on (its training
    config's ``dataset``, which locates ``data/<dataset>/meta.pkl``), and the file read."""
    file = _ckpt_file(path)
    data = load_pickle(file)
    if not isinstance(data, dict) or "model_args" not in data or "model" not in data:
        raise _error(
            f"{str(file)!r} is not a nanoGPT checkpoint (expected a dict with 'model_args' and 'model').",
            "pass the ckpt.pt written by nanoGPT's train.py, or a Hugging Face GPT-2 folder.",
        )
    args = data["model_args"]
    fields = GPTConfig.__dataclass_fields__
    # A key the model here does not know may change the math (a fork's extra option):
    # refused by name, never dropped.
    unknown = sorted(str(k) for k in args if k not in fields)
    if unknown:
        raise _error(
            f"{str(file)!r}: model_args {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not part of "
            f"nanoGPT's GPTConfig ({', '.join(fields)}), so the exported model would not compute what it says.",
            "export the checkpoint with the model family that implements those options, or remove them from "
            "model_args if they are known not to change the forward pass.",
        )
    config = GPTConfig(**args)
    state = {k.removeprefix("_orig_mod."): v for k, v in data["model"].items()}
    train_config = data.get("config")
    dataset = train_config.get("dataset") if isinstance(train_config, dict) else None
    return build_model(config, state, str(file)), dataset if isinstance(dataset, str) else None, file


def load_nanogpt(path: Path, options: LoadOptions, tokenizer: Optional[Tokenizer]) -> LoadedModel:
    model, _, _ = read_nanogpt(path)
    return LoadedModel(model, metadata=None, tokenizer=tokenizer)


# ---- Hugging Face GPT-2 -------------------------------------------------------------------


def matches_hf(path: Path) -> bool:
    folder = path if path.is_dir() else path.parent
    return (folder / "config.json").is_file() and (
        (folder / "model.safetensors").is_file() or (folder / "pytorch_model.bin").is_file()
    )


def claims_hf(path: Path) -> bool:
    """A GPT-2 folder: its config.json says ``model_type: gpt2``."""
    if not matches_hf(path):
        return False
    folder = path if path.is_dir() else path.parent
    try:
        config = folder / "config.json"
        return nesting.loads(config.read_text(), what=str(config), plugin="nanogpt").get("model_type") == "gpt2"
    except (OSError, ValueError, AttributeError):
        return False


def load_hf(path: Path, options: LoadOptions, tokenizer: Optional[Tokenizer]) -> LoadedModel:
    folder = path if path.is_dir() else path.parent
    try:
        hf = nesting.loads((folder / "config.json").read_text(), what=str(folder / "config.json"), plugin="nanogpt")
    except (OSError, ValueError) as exc:
        raise _error(f"cannot read {folder / 'config.json'}: {exc}", "check the config.json of the checkpoint.") from None
    if hf.get("model_type", "gpt2") != "gpt2":
        raise _error(
            f"{folder} holds a {hf.get('model_type')!r} model, not GPT-2.",
            "use the model family that provides this architecture (see `llmcore plugins`).",
        )
    _refuse_other_math(hf, folder)
    config = GPTConfig(
        block_size=hf.get("n_positions", hf.get("n_ctx", 1024)),
        vocab_size=hf["vocab_size"],
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        bias=True,
    )
    if (folder / "model.safetensors").is_file():
        state = _read_safetensors(folder / "model.safetensors")
    else:
        state = load_pickle(folder / "pytorch_model.bin")
    renamed = {}
    for key, value in state.items():
        key = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
        if key.endswith(CONV1D_SUFFIXES) and value.dim() == 2:
            value = value.t().contiguous()
        renamed[key] = value
    model = build_model(config, renamed, str(folder))
    for module in model.modules():
        if isinstance(module, LayerNorm):
            module.eps = float(hf.get("layer_norm_epsilon", 1e-5))
    return LoadedModel(model, metadata=None, tokenizer=tokenizer)


# config.json keys of transformers' GPT-2 that change what it computes, and the values under
# which it computes what this model does; another value is refused by name, never ignored
# (layer_norm_epsilon is applied; the sizes are read).
HF_MATH_KEYS = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # both the tanh GELU this model computes
    "n_inner": (None,),  # None: 4 x n_embd, the MLP here
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "add_cross_attention": (False,),
}


def _refuse_other_math(hf: dict, folder: Path) -> None:
    for key, allowed in HF_MATH_KEYS.items():
        value = hf.get(key, allowed[0])
        if key == "n_inner" and value == 4 * hf.get("n_embd", 0):
            continue
        if value not in allowed:
            raise _error(
                f"{folder}: config.json sets {key}={value!r}, which GPT-2 here does not compute "
                f"(it takes {' or '.join(repr(a) for a in allowed)}), so the program would not compute what the "
                "checkpoint does.",
                "export the checkpoint with the model family that implements it.",
            )


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise _error(
            f"{str(file)!r} is not a readable safetensors file ({str(exc)[:160]}).",
            "check that the download is complete.",
        ) from None
