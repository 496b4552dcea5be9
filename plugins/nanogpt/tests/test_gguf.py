"""GPT-2 GGUFs as llama.cpp's converter writes them (the gguf package's own tensor-name map
for ``gpt2``, Conv1D weights transposed to [out, in]) against transformers' own GPT-2: eager
logits, a quantized file's weights against the gguf package's decoding, the keys GPT-2 does
not have refused by name, and a Q4_0 file exported as a user runs it (its layers on
llmcore's kernels, the program agreeing with its eager model and with transformers' GPT-2
holding the file's weights)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmcore.errors import LlmcoreError
from llmcore.records import LoadOptions

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
Q = gguf.GGMLQuantizationType


def reference(seed: int = 0, n_embd: int = 64, n_layer: int = 2, n_head: int = 4, vocab: int = 96,
              eps: float = 1e-5):
    """transformers' GPT2LMHeadModel with random weights, biases and norms away from 0 and 1."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, vocab_size=vocab,
                                     n_positions=64, layer_norm_epsilon=eps)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name or name.startswith("transformer.ln_f"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def write_gpt2_gguf(model, path, quantize: dict | None = None, extra_keys: dict | None = None) -> dict:
    """``model``'s weights as a ``gpt2`` GGUF: names from the gguf package's map, Conv1D weights
    transposed, ``quantize`` {GGUF suffix (``attn_qkv.weight``): type} for 2-D weights, F32 else.
    Returns {gguf name: (type, stored array)}."""
    from llmcore_llama.testing import finish_gguf

    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, c.n_layer)
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(c.n_layer)
    w.add_context_length(c.n_positions)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(4 * c.n_embd)
    w.add_head_count(c.n_head)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    for key, value in (extra_keys or {}).items():
        w.add_uint32(key, value)
    quantize = quantize or {}
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":  # mask buffers; tied
            continue
        if name.endswith(CONV1D):
            t = t.t()
        gguf_name = gguf_tensor_name(names, name)
        suffix = gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name
        tensors[gguf_name] = (quantize.get(suffix) if t.dim() == 2 else None, t.float().contiguous().numpy())
    return finish_gguf(w, tensors)


def gguf_tensor_name(names, name: str) -> str:
    """The GGUF name of transformers' parameter ``name`` (``names``: the gguf package's map)."""
    base, _, kind = name.rpartition(".")
    return f"{names.get_name(base)}.{kind}"


@pytest.fixture
def kernels_built():
    """llmcore-kernels' library, which ``make test`` builds (``make runner``) before the tests."""
    library = pytest.importorskip("llmcore_kernels.library")
    if not (library.library_dir() / library.AOT_LIBRARY).is_file():
        pytest.skip("llmcore-kernels' library is not built (make runner)")


def load(path, **options):
    from llmcore_nanogpt import gguf_loader

    return gguf_loader.load_gguf(path, LoadOptions(**options))


def test_an_f32_gguf_computes_what_transformers_computes(tmp_path):
    import llmcore_nanogpt

    ref = reference(eps=0.05)  # an eps that moves the logits: the file's, read and applied
    path = tmp_path / "gpt2.gguf"
    write_gpt2_gguf(ref, path)
    family = llmcore_nanogpt.llmcore_model_families()[0]
    assert family.loader("gguf").claims(path)
    loaded = load(path)
    tokens = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits[:, -1]
        got = loaded.module(tokens)
    assert float((got - want).abs().max()) < 1e-4
    assert loaded.module.lm_head.weight is loaded.module.transformer.wte.weight  # tied, one table


def test_quantized_weights_are_the_gguf_packages_decoding(tmp_path):
    ref = reference()
    path = tmp_path / "gpt2-q.gguf"
    stored = write_gpt2_gguf(ref, path, {"attn_qkv.weight": Q.Q4_0, "ffn_up.weight": Q.Q4_1,
                                         "ffn_down.weight": Q.Q8_0, "token_embd.weight": Q.Q8_0})
    module = load(path).module
    for gguf_name, ours in (("blk.0.attn_qkv.weight", module.transformer.h[0].attn.c_attn.weight),
                            ("blk.1.ffn_up.weight", module.transformer.h[1].mlp.c_fc.weight),
                            ("blk.1.ffn_down.weight", module.transformer.h[1].mlp.c_proj.weight),
                            ("token_embd.weight", module.transformer.wte.weight)):
        qt, data = stored[gguf_name]
        want = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qt), dtype=np.float32))
        assert torch.equal(ours.detach(), want.reshape(ours.shape)), gguf_name


def test_keys_gpt2_does_not_have_are_refused_by_name(tmp_path):
    path = tmp_path / "gpt2-rope.gguf"
    write_gpt2_gguf(reference(), path, extra_keys={"gpt2.rope.dimension_count": 16})
    with pytest.raises(LlmcoreError, match=r"gpt2\.rope\.dimension_count"):
        load(path)


@pytest.mark.parametrize("plugins", [(), ("--plugins", "xnnpack")], ids=["default", "xnnpack"])
def test_a_q4_0_gguf_exports_with_the_files_integers(tmp_path, kernels_built, plugins):
    """``llmcore export --checkpoint FILE`` with nothing else: the gguf recipe keeps the file's
    integers and each layer runs on llmcore's kernels. With ``--plugins xnnpack`` the family
    splits c_attn into q, k and v for XNNPACK, and each part keeps its rows' integers, still
    read from the file (llmcore.stored.stored_rows). Either program agrees with its eager model."""
    from llmcore.runtime import libraries
    from llmcore_llama.testing import llmcore_cli

    from llmcore_nanogpt.tokenizer import byte_level_tokenizer

    ref = reference(n_embd=128, vocab=257)
    tokenizer = tmp_path / "tokenizer.json"  # the file has none: byte-level, for its 257 tokens
    tokenizer.write_text(byte_level_tokenizer().json_text)
    path = tmp_path / "gpt2-q4.gguf"
    write_gpt2_gguf(ref, path, dict.fromkeys(("attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                                              "ffn_down.weight"), Q.Q4_0))
    out = tmp_path / "gpt2.pte"
    run = llmcore_cli("export", "--checkpoint", str(path), "--tokenizer", str(tokenizer), *plugins, "-o", str(out))
    assert run.returncode == 0, run.stderr
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert report["model"]["family"] == "nanogpt" and report["quantization"]["recipe"] == "gguf"
    kept = 12 if plugins else 8  # 2 layers x (q, k, v, c_proj, c_fc, c_proj) or (c_attn, ...)
    # every Q4_0 matrix kept; the one float linear is the output layer (the tied table, F32 here)
    assert f"{kept} Q4_0 kept" in run.stderr and "; 1 float kept" in run.stderr, run.stderr
    ops = set(libraries.program_operators(out.read_bytes()))
    if not plugins:
        taken = next(t for t in report["taken"] if t["backend"] == "kernels")
        assert {"transformer.h.0", "transformer.h.1"} <= set(taken["taken"]), taken
        assert "llmcore::int4_layer_norm_ffn_add.out" in ops and "llmcore::int4_layer_norm_linear.out" in ops
    else:
        assert not any(op.startswith("llmcore::int4") for op in ops)
    assert report["parity"]["top1_agreement"] == 1.0 and report["parity"]["max_abs_diff"] < 0.05, report["parity"]


def test_the_default_program_computes_what_transformers_computes_on_the_files_weights(tmp_path, kernels_built):
    """Issue 60's check of a family on the kernels, for GPT-2: a Q4_0 file exported as a user
    exports it (every layer on llmcore's kernels) against transformers' GPT2LMHeadModel holding
    the file's weights as the gguf package decodes them: the last logits after prompts of 1, 7
    and 20 tokens, and 16 greedy tokens. The program rounds activations to int8 per token
    (the kernels' GEMMs), transformers computes in fp32: a small relative error, and each
    greedy token transformers' choice up to a near tie."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions
    from llmcore.runtime import Program
    from llmcore.runtime.generate import Sampling, generate

    from llmcore_nanogpt.tokenizer import byte_level_tokenizer

    ref = reference(n_embd=128, vocab=257)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(byte_level_tokenizer().json_text)
    path = tmp_path / "gpt2-q4.gguf"
    stored = write_gpt2_gguf(ref, path, dict.fromkeys(("attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                                                       "ffn_down.weight"), Q.Q4_0))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, ref.config.n_layer)
    with torch.no_grad():  # transformers with the file's weights
        for name, p in ref.named_parameters():
            if name == "lm_head.weight":  # tied to wte
                continue
            qt, data = stored[gguf_tensor_name(names, name)]
            if qt != Q.F32:
                decoded = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qt), dtype=np.float32))
                p.copy_(decoded.t() if name.endswith(CONV1D) else decoded.reshape(p.shape))
    result = export(ExportOptions(checkpoint=str(path), tokenizer=str(tokenizer), output=str(tmp_path / "gpt2.pte"),
                                  quiet=True), load_registry())
    taken = next(t for t in result.report["taken"] if t["backend"] == "kernels")
    assert {"transformer.h.0", "transformer.h.1"} <= set(taken["taken"]), taken

    program = Program.load(result.pte)
    generator = torch.Generator().manual_seed(3)
    for length in (1, 7, 20):
        ids = torch.randint(0, 257, (1, length), generator=generator)
        got = torch.as_tensor(program.logits(ids[0].tolist(), input_pos=0))
        with torch.no_grad():
            want = ref(ids).logits[0, -1]
        assert float((got - want).norm() / want.norm()) < 0.01, length  # measured 0.0021-0.0031
        assert int(got.argmax()) == int(want.argmax()), length

    prompt = [5, 80, 120, 33, 200]
    reply = generate(program, prompt, 16, Sampling(temperature=0), stop_at_eos=False).generated_ids
    assert len(reply) == 16
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1:-1]
    for step, (token, row) in enumerate(zip(reply, logits)):
        # a near tie: the program's choice within 0.5% of the logits' spread of transformers' best
        assert float(row.max() - row[token]) <= 0.005 * float(row.max() - row.min()), (step, token, int(row.argmax()))
