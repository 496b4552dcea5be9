"""llama.cpp's ``gpt2`` GGUF files: GPT-2 with its matrices quantized (Q4_0, Q4_1, Q8_0 ...).

The file is read with the llama plugin's GGUF reader (its header walk, its dequantizers, its
records of the integers a matrix stores), which is where llmcore reads every GGUF; only the
names and the metadata keys are GPT-2's. Tensor names as llama.cpp's converter writes them
(``token_embd``, ``position_embd``, ``blk.N.attn_norm``, ``attn_qkv``, ``attn_output``,
``ffn_norm``, ``ffn_up``, ``ffn_down``, ``output_norm``, an optional ``output``: tied to the
embedding when absent) map onto nanoGPT's. A quantized matrix is left in the file
(:class:`llmcore.stored.FileWeight`) when the export asks for stored integers (``--quantize
gguf``, the default for a quantized GGUF), so the program carries the file's own integers.

Metadata keys under ``gpt2.`` that this model does not implement are refused by name: a key
that changes the computation is never ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from llmcore.checkpoints import check_state_dict
from llmcore.errors import LlmcoreError
from llmcore.modules import LayerNorm
from llmcore.records import LoadedModel, LoadOptions, ModelMetadata, Tokenizer

from llmcore_nanogpt.model import GPT, GPTConfig

PLUGIN = "nanogpt"
ARCH = "gpt2"
TOP = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
LAYER = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
         "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# gpt2.<key> -> what it is; every one is read (or checked) below
KEYS = {
    "context_length": "the positions table's rows (the longest program)",
    "embedding_length": "the model width",
    "feed_forward_length": "the MLP's hidden size: must be 4x the width (GPT-2's)",
    "block_count": "the layers",
    "attention.head_count": "the heads",
    "attention.head_count_kv": "must equal the heads (GPT-2 has no grouped-query attention)",
    "attention.layer_norm_epsilon": "every LayerNorm's eps",
    "vocab_size": "the vocabulary: must be the embedding's rows",
}


def _error(message: str, fix: str) -> LlmcoreError:
    return LlmcoreError(message, stage="load", plugin=PLUGIN, fix=fix)


def claims(path: Path) -> bool:
    from llmcore_llama import formats

    return formats.gguf_architecture(Path(path)) == ARCH


def _name(gguf_name: str) -> Optional[str]:
    """nanoGPT's name for a GGUF tensor, or None for one GPT-2 does not have."""
    if gguf_name in TOP:
        return TOP[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER and parts[3] in (
            "weight", "bias"):
        return f"transformer.h.{parts[1]}.{LAYER[parts[2]]}.{parts[3]}"
    return None


def _config(g, tensors: dict) -> tuple[GPTConfig, float]:
    unknown = sorted(k for k in g.fields if k.startswith(f"{ARCH}.") and k[len(ARCH) + 1:] not in KEYS)
    if unknown:
        raise _error(f"{g.path}: metadata {', '.join(unknown)} is not part of GPT-2 as llmcore implements it "
                     f"(it reads {', '.join(KEYS)}), so the program would not compute what the file says.",
                     "export the file with the model family that implements those keys.")
    key = lambda suffix, kind=int: g.require(f"{ARCH}.{suffix}", kind)  # noqa: E731
    n_embd, n_head, n_layer = key("embedding_length"), key("attention.head_count"), key("block_count")
    n_kv = g.get(f"{ARCH}.attention.head_count_kv", n_head)
    if n_kv != n_head:
        raise _error(f"{g.path}: {ARCH}.attention.head_count_kv is {n_kv}, not the {n_head} heads: GPT-2 has no "
                     "grouped-query attention.", "export a GPT-2 file, or the family whose model this is.")
    if key("feed_forward_length") != 4 * n_embd:
        raise _error(f"{g.path}: {ARCH}.feed_forward_length is {key('feed_forward_length')}, not 4 x {n_embd}: "
                     "GPT-2's MLP is four times its width.", "export a GPT-2 file.")
    if "token_embd.weight" not in tensors:
        raise _error(f"{g.path} has no token_embd.weight.", "convert the model again with llama.cpp's converter.")
    vocab = tensors["token_embd.weight"][1][0]
    if g.get(f"{ARCH}.vocab_size", vocab) != vocab:
        raise _error(f"{g.path}: {ARCH}.vocab_size says {g.get(f'{ARCH}.vocab_size')} but token_embd has {vocab} rows.",
                     "convert the model again with llama.cpp's converter.")
    config = GPTConfig(block_size=key("context_length"), vocab_size=vocab, n_layer=n_layer, n_head=n_head,
                       n_embd=n_embd, bias=True)
    return config, float(key("attention.layer_norm_epsilon", float))


def load_gguf(path: Path, options: LoadOptions) -> LoadedModel:
    """A llama.cpp ``gpt2`` GGUF as nanoGPT's GPT, with the file's tokenizer."""
    from llmcore.stored import attach
    from llmcore_llama import formats, quants
    from llmcore_llama.loaders import GGUFFile, file_weight
    from llmcore_llama.tokenization import TokenizerError, tokenizer_from_gguf_fields

    path = Path(path)
    if not formats.is_gguf(path):
        raise _error(f"{path} is not a GGUF file (no GGUF magic).", "pass a GGUF file.")
    g = GGUFFile(path, PLUGIN)
    tensors = {t.name: (t, tuple(int(d) for d in reversed([int(x) for x in t.shape]))) for t in g.tensors}
    config, eps = _config(g, tensors)
    unknown = [name for name in tensors if _name(name) is None]
    if unknown:
        raise _error(f"{path} has tensors GPT-2 does not use: {', '.join(unknown[:5])}.",
                     "use the model family that matches this GGUF (see `llmcore plugins`).")
    tokenizer = None
    if options.tokenizer_path is None and g.get("tokenizer.ggml.model") is not None:
        try:
            tokenizer = tokenizer_from_gguf_fields(g.get)
        except TokenizerError as e:
            raise _error(f"{path}: {e}", "pass --tokenizer with the model's tokenizer.json.") from None
    g.release_metadata()

    state, stored = {}, {}
    for gguf_name, (t, shape) in tensors.items():
        name, qtype = _name(gguf_name), int(t.tensor_type)
        # the matrices the recipe replaces stay in the file; the positions table is looked up
        # by the graph as floats, so it is read here whatever its type
        if (options.stored_integers and len(shape) == 2 and qtype not in quants.FLOAT_TYPES
                and name != "transformer.wpe.weight"):
            stored[name] = file_weight(g, t, qtype, gguf_name, shape[1], shape[0])
            state[name] = torch.empty(shape, device="meta")
            continue
        state[name] = quants.dequantize(t.data, qtype, shape).float()
        g.drop_pages(t)
    with torch.device("meta"):
        model = GPT(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight" or k in state}
    check_state_dict(expected, state, plugin=PLUGIN,
                     source=f"{path} does not fit a GPT-2 with n_layer={config.n_layer}, n_head={config.n_head}, "
                     f"n_embd={config.n_embd}, vocab_size={config.vocab_size}",
                     fix="convert the model again with llama.cpp's converter.",
                     file_name=lambda n: next((g_name for g_name in tensors if _name(g_name) == n), n))
    model.load_state_dict(state, strict=False, assign=True)
    if "lm_head.weight" not in state:  # tied, as GPT-2 is: the one table serves both
        model.lm_head.weight = model.transformer.wte.weight
    for module in model.modules():
        if isinstance(module, LayerNorm):
            module.eps = eps
    model.eval()
    loaded = LoadedModel(
        module=model,
        metadata=ModelMetadata(
            vocab_size=config.vocab_size, max_seq_len=config.block_size,
            bos_id=tokenizer.bos_id if tokenizer else -1, eos_ids=tuple(tokenizer.eos_ids) if tokenizer else (),
            n_bos=tokenizer.n_bos if tokenizer else 0, chat_template=tokenizer.chat_template if tokenizer else None),
        tokenizer=Tokenizer(json_text=tokenizer.json_text, description=tokenizer.description) if tokenizer else None,
        family=PLUGIN,
        source=str(path),
    )
    loaded.stored_weights = stored
    attach(model, stored)  # a layer whose weight is still in the file refuses to run
    return loaded
