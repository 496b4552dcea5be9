"""Test helpers for the families built on this decoder (llama, qwen, phi, ...).

Each family's tests save tiny random checkpoints with transformers' own classes and compare
llmcore against transformers' model read back from the folder; these are the pieces they
share. transformers is imported only when a helper runs (it is a test extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

VOCAB = 320
MAX_POS = 64
LENGTHS = (1, 17, MAX_POS)
"""Prefill lengths the logits are compared at: one token, an odd middle, the full program."""


def save_random_hf(folder: Path, kind: str, *, seed: int = 0, tokenizer: bool = True, config_kind: str = "",
                   **config) -> Path:
    """A random ``{kind}ForCausalLM`` (``kind``: ``Llama``, ``Qwen2``, ``Phi3`` ...; its config
    class ``{config_kind or kind}Config``: Gemma 3's text model takes ``Gemma3TextConfig``) of
    ``config`` (transformers' names; dim 64, 2 layers, 4/2 heads, ffn 160, vocab 320, 64
    positions unless given) saved by transformers, with weights large enough that a
    misread bias, norm, layout or RoPE setting moves the logits by far more than 1e-4."""
    import transformers

    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=160, vocab_size=VOCAB, max_position_embeddings=MAX_POS)
    cfg = getattr(transformers, (config_kind or kind) + "Config")(**{**shape, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, kind + "ForCausalLM")(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(str(folder), safe_serialization=True)
    if tokenizer:
        write_tokenizer(folder)
    return folder


def write_tokenizer(folder: Path) -> None:
    """The tiny byte-level BPE (320 ids) with a ChatML-style template."""
    from .tokenization import tiny_tokenizer

    tok = tiny_tokenizer(VOCAB)
    (folder / "tokenizer.json").write_text(tok.json_text)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|eot_id|>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }))


def edit_config(folder: Path, change: Callable[[dict], object]) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def check_refused_by_name(load: Callable[[Path], object], folder: Path, change: Callable[[dict], object],
                          plugin: str, named: list[str]) -> None:
    """``change`` to the folder's config.json makes ``load(folder)`` refuse it at load, in one
    line that names ``plugin``, each of ``named`` (the key and its value) and a fix: the rule
    that a key which changes the computation is implemented or refused, never ignored."""
    import pytest

    from llmcore.errors import LlmcoreError

    edit_config(folder, change)
    with pytest.raises(LlmcoreError) as e:
        load(folder)
    err = e.value
    assert err.stage == "load" and err.plugin == plugin and err.fix and "\n" not in str(err), str(err)
    for name in named:
        assert name in str(err), str(err)


def reference(folder: Path):
    """transformers' own model, read back from ``folder`` in float32."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.reshape(-1) - b.reshape(-1)).abs().max().item()


def greedy(next_logits: Callable[[list[int]], torch.Tensor], prompt: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens, ``next_logits(all tokens so far) -> logits of the last``."""
    out = list(prompt)
    for _ in range(steps):
        out.append(int(torch.argmax(next_logits(out))))
    return out[len(prompt):]


def program_next(program, prompt_len: int) -> Callable[[list[int]], torch.Tensor]:
    """:func:`greedy`'s ``next_logits`` for a KV-cache program: the prompt in one call,
    then one token at a time at its position."""

    def step(ids: list[int]) -> torch.Tensor:
        return program.logits(ids, 0) if len(ids) == prompt_len else program.logits(ids[-1:], len(ids) - 1)

    return step


def reference_next(model) -> Callable[[list[int]], torch.Tensor]:
    """:func:`greedy`'s ``next_logits`` for a transformers model (the whole sequence each step)."""

    def step(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1]

    return step


def llmcore_cli(*args: str, env: dict | None = None):
    """``python -m llmcore ARGS`` as a subprocess, as a user runs it (``env`` added to the
    environment); the ``CompletedProcess`` with text output."""
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "llmcore", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def export_cli(folder: Path, out: Path, *flags: str) -> dict:
    """``llmcore export --checkpoint folder --plugins xnnpack ... -o out`` as a user runs it
    (a subprocess, no ``--model``: the family comes from the checkpoint); its report."""
    out.parent.mkdir(parents=True, exist_ok=True)
    run = llmcore_cli("export", "--checkpoint", str(folder), "--plugins", "xnnpack", "--quiet", *flags, "-o", str(out))
    assert run.returncode == 0, run.stderr
    return json.loads(out.with_suffix(".report.json").read_text())


def check_eager_against(module, ref, atol: float) -> float:
    """llmcore's eager ``module`` against transformers' ``ref``: last-position logits of
    each of :data:`LENGTHS` within ``atol``. Returns the largest difference."""
    worst = 0.0
    for n in LENGTHS:
        toks = tokens(n, seed=n)
        with torch.no_grad():
            diff = max_diff(module(toks)[0], ref(toks).logits[0, -1])
        assert diff <= atol, f"length {n}: max |diff| {diff}"
        worst = max(worst, diff)
    return worst


def check_program_against(program_path: Path, ref, atol: float) -> float:
    """The ``.pte`` at ``program_path`` against transformers' ``ref``: last-position logits
    after a prefill of each of :data:`LENGTHS` within ``atol``, then 16 greedy tokens
    through the KV cache equal to ``ref``'s. Returns the largest logit difference."""
    from llmcore.runtime import Program

    program = Program.load(program_path)
    worst = 0.0
    for n in LENGTHS:
        toks = tokens(n, seed=n)
        with torch.no_grad():
            expected = ref(toks).logits[0, -1]
        diff = max_diff(program.logits(toks[0].tolist(), 0), expected)
        assert diff <= atol, f"{program_path.name}, length {n}: max |diff| {diff}"
        worst = max(worst, diff)
    prompt = tokens(5, seed=1)[0].tolist()
    assert greedy(program_next(program, len(prompt)), prompt, 16) == greedy(reference_next(ref), prompt, 16)
    return worst


LONG_POSITIONS = 1024
"""max_position_embeddings of a checkpoint for :func:`check_long_prompt_against`, whose
program is exported with ``--max-seq-len`` :data:`LONG_SEQ_LEN`."""
LONG_SEQ_LEN = 640


def check_long_prompt_against(program_path: Path, ref, atol: float, prompt_len: int = 600, steps: int = 15) -> float:
    """A long context: the ``.pte``'s logits after a ``prompt_len``-token prompt and for
    ``steps`` decode steps, each within ``atol`` of transformers' ``ref`` on the same tokens.
    From 512 keys on, the runtime's attention kernel (runtime/kernels/llm_ops.cpp) takes a
    decode step's kv heads in one item (``kWholeHeadsFrom``); the tiny programs of
    :func:`check_program_against` never reach it. Each call's logits are compared, not
    greedy tokens: a random model may pick one token over and over. Returns the largest
    difference."""
    from llmcore.runtime import Program

    program, seq = Program.load(program_path), tokens(prompt_len + steps + 1, seed=5)[0].tolist()
    got = [program.logits(seq[:prompt_len], 0)]
    got += [program.logits([t], i) for i, t in enumerate(seq[prompt_len:prompt_len + steps], start=prompt_len)]
    with torch.no_grad():
        want = ref(torch.tensor([seq])).logits[0, prompt_len - 1:prompt_len + steps]
    diff = max_diff(torch.stack([torch.as_tensor(row).reshape(-1) for row in got]), want)
    assert diff <= atol, f"{program_path.name}, a {prompt_len}-token prompt and {steps} decode steps: max |diff| {diff}"
    return diff


# Ops that must not be left outside XNNPACK in a decoder layer (norms, RoPE, projections).
LAYER_OPS = ("aten_mean_dim", "aten_mul_tensor", "aten_mm_default", "aten_linear_default", "aten_add_tensor")


def check_one_delegate_per_layer(report: dict, n_layers: int) -> None:
    """The only breaks in a layer are the KV-cache ops: at most one XNNPACK delegate per
    layer plus the two ends, no layer op outside, and the program agrees with its eager model."""
    not_delegated = {row["op_type"]: row["not_delegated"] for row in report["delegation"]["operators"]}
    assert report["delegation"]["delegated_subgraphs"] <= n_layers + 2, report["delegation"]
    assert not any(not_delegated.get(op, 0) for op in LAYER_OPS), not_delegated
    assert report["parity"]["top1_agreement"] >= 0.9, report["parity"]


def write_gguf(
    folder: Path,
    path: Path,
    *,
    quantize: dict | None = None,
    metadata: Callable[[object, dict], None] | None = None,
    convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    extra_tensors: dict | None = None,
) -> dict:
    """Convert the transformers checkpoint in ``folder`` to a GGUF as llama.cpp's
    convert_hf_to_gguf.py does for the NEOX-RoPE families (Qwen, Phi-3, Gemma): the gguf
    package's own tensor-name map for the architecture, q/k rows left in Hugging Face's
    rotate-half order, 1-D tensors in F32.

    The file's architecture is config.json's ``model_type`` as llama.cpp names it; its
    common keys come from config.json. ``metadata(writer, cfg)`` adds the family's own keys,
    ``convert(hf_name, tensor)`` changes a tensor as the converter does (Gemma's norms
    ``+ 1``), ``extra_tensors`` are added as they are (Phi-3's LongRoPE factors).
    ``quantize`` maps a tensor's name (``blk.2.ffn_down.weight``: one layer's), a layer
    suffix (``attn_q.weight``: every layer's) or a top-level name to a GGMLQuantizationType
    for 2-D weights. Returns {gguf name: (type, stored array)}."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = {"gemma3_text": "gemma3"}.get(cfg["model_type"], cfg["model_type"])
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if metadata is not None:
        metadata(w, cfg)
    tensors = {}
    for hf_name, t in load_file(str(next(folder.glob("*.safetensors")))).items():
        base, _, kind = hf_name.rpartition(".")
        tensors[f"{names.get_name(base)}.{kind}"] = (convert(hf_name, t) if convert else t).float().numpy()
    tensors.update(extra_tensors or {})
    quantize = quantize or {}

    def type_of(name: str):
        return quantize.get(name, quantize.get(name.split(".", 2)[-1]) if name.startswith("blk.") else None)

    return finish_gguf(w, {name: (type_of(name) if arr.ndim == 2 else None, arr) for name, arr in tensors.items()})


def finish_gguf(writer, tensors: dict) -> dict:
    """Add ``tensors`` ({gguf name: (GGMLQuantizationType or None for F32, float32 array)};
    F16 is cast, other types quantized by the gguf package, a uint8 array of a quantized
    type taken as its ready-made blocks) and write the file. Returns {name: (type, stored
    array)}."""
    import gguf
    import numpy as np
    from gguf import quants as gq

    Q = gguf.GGMLQuantizationType
    stored = {}
    for name, (qt, arr) in tensors.items():
        qt = Q.F32 if qt is None else qt
        if qt == Q.F32:
            data = arr
            writer.add_tensor(name, data)
        elif qt == Q.F16:
            data = arr.astype(np.float16)
            writer.add_tensor(name, data)
        else:
            data = arr if arr.dtype == np.uint8 else gq.quantize(arr, qt)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt)
        stored[name] = (qt, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


# A decoder layer's tensors: the decoder's (Meta) name -> Hugging Face's and llama.cpp's, for
# tests that write checkpoints (written out apart from the loaders' own tables, which they check).
HF_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
GGUF_LAYER_NAMES = {
    "attention_norm.weight": "attn_norm.weight",
    "attention.wq.weight": "attn_q.weight",
    "attention.wk.weight": "attn_k.weight",
    "attention.wv.weight": "attn_v.weight",
    "attention.wo.weight": "attn_output.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
}


def gguf_name(meta_name: str) -> str:
    """The GGUF tensor name of a Meta parameter name (``layers.0.attention.wq.weight`` ->
    ``blk.0.attn_q.weight``)."""
    top = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "output.weight": "output.weight"}
    if meta_name in top:
        return top[meta_name]
    _, i, rest = meta_name.split(".", 2)
    return f"blk.{i}.{GGUF_LAYER_NAMES[rest]}"


def write_llama_gguf(path: Path, sd: dict, c, *, types: dict | None = None, arch: str = "llama",
                     tokenizer: dict | None = None, raw: dict | None = None, metadata=None) -> dict:
    """Write `sd` (the decoder's Meta names and layout, of :class:`~llmcore_llama.config.LlamaConfig`
    ``c``) as a GGUF. `types` maps meta names to a GGMLQuantizationType (default F32); `raw`
    maps meta names to ready-made raw blocks (uint8 arrays) with their type; `tokenizer` gives
    the tokenizer keys; `metadata(writer)` adds more keys. Returns {gguf name: (ggml type,
    stored array)}."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.dim)
    w.add_feed_forward_length(c.hidden_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.resolved_head_dim)
    if tokenizer:
        w.add_tokenizer_model(tokenizer["model"])
        if "pre" in tokenizer:
            w.add_tokenizer_pre(tokenizer["pre"])
        w.add_token_list(tokenizer["tokens"])
        w.add_token_types(tokenizer["types"])
        if "merges" in tokenizer:
            w.add_token_merges(tokenizer["merges"])
        if "scores" in tokenizer:
            w.add_token_scores(tokenizer["scores"])
        w.add_bos_token_id(tokenizer["bos"])
        w.add_eos_token_id(tokenizer["eos"])
        w.add_add_bos_token(tokenizer.get("add_bos", False))
        if "add_space_prefix" in tokenizer:
            w.add_add_space_prefix(tokenizer["add_space_prefix"])
        if tokenizer.get("chat_template"):
            w.add_chat_template(tokenizer["chat_template"])
    if metadata is not None:
        metadata(w)
    types, raw = types or {}, raw or {}
    tensors = {}
    for name, t in sd.items():
        qt, arr = raw[name] if name in raw else (types.get(name), t.detach().float().numpy())
        tensors[gguf_name(name)] = (qt, arr)
    return finish_gguf(w, tensors)


def random_k_blocks(qt, rows: int, cols: int, seed: int = 0, scale: float = 0.01):
    """Random but well-formed K-quant bytes for a rows x cols tensor (the gguf package cannot
    write K-quants from floats): random quants and sub-block scales, small finite float16
    super-block scales (normal, standard deviation ``scale``). For finish_gguf (``quantize``
    naming the type) or write_gguf's ``extra_tensors``."""
    import gguf
    import numpy as np

    vpb, bpb = gguf.GGML_QUANT_SIZES[qt]
    assert cols % vpb == 0
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // vpb, bpb), dtype=np.uint8)
    name = gguf.GGMLQuantizationType(qt).name
    f16_offsets = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [bpb - 2], "Q2_K": [bpb - 4, bpb - 2], "Q3_K": [bpb - 2]}[name]
    for off in f16_offsets:
        blocks[:, off:off + 2] = np.frombuffer(
            (rng.standard_normal(blocks.shape[0]) * scale).astype(np.float16).tobytes(), dtype=np.uint8
        ).reshape(-1, 2)
    return blocks.reshape(rows, cols // vpb * bpb)


# The matrices of a decoder layer as llama.cpp names them (for quantizing a test GGUF).
GGUF_LAYER_MATRICES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                       "ffn_up.weight", "ffn_down.weight")


def gguf_recipe_export(path: Path, tokenizer: Path, out: Path, *flags: str) -> dict:
    """``llmcore export --checkpoint GGUF --plugins xnnpack --quantize gguf`` as a user runs
    it (no --model: the family comes from the file); checks the program agrees with its
    eager model on the next token everywhere; returns the report."""
    run = llmcore_cli("export", "--checkpoint", str(path), "--tokenizer", str(tokenizer), *flags, "--plugins",
                      "xnnpack", "--quantize", "gguf", "--quiet", "-o", str(out))
    assert run.returncode == 0, run.stderr
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert report["parity"]["top1_agreement"] == 1.0, report["parity"]
    return report
