"""The ``kernels`` backend: llmcore's layer operators chosen without a flag.

An export with a recipe (or a checkpoint) and no ``--plugins`` gets ``kernels,xnnpack``:
the kernels take each layer they compute exactly, XNNPACK the rest, and the report and the
summary say which and why. Checked against the same recipe on XNNPACK alone (the same
integers: the logits must agree) and against the eager module (the export's parity check)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from llmcore.errors import LlmcoreError

IDS = [1, 40, 50, 60, 70, 80, 90]
LAYER_OPS = ("int4_norm_qkv_rope", "int4_linear_add", "int4_norm_mlp_add")
# Gemma's: a post-norm on the attention's output, and the MLP (GeGLU, with its post-norm)
SANDWICH_OPS = ("int4_linear_norm_add", "int4_norm_glu_add")


def _export(folder, name, **options):
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    return export(ExportOptions(output=str(folder / f"{name}.pte"), quiet=True, **options), load_registry())


@pytest.fixture(scope="module")
def default_and_xnnpack(kernel_library, tmp_path_factory):
    """Per family: 8da4w without --plugins (the default list), and 8da4w for XNNPACK alone."""
    folder = tmp_path_factory.mktemp("backend")
    return {config: (_export(folder, f"{config}-default", model=family, config=config, quantize="8da4w"),
                     _export(folder, f"{config}-xnnpack", model=family, config=config, quantize="8da4w",
                             plugins=["xnnpack"]))
            for family, config in FAMILIES}


FAMILIES = [("llama", "tiny"), ("qwen", "qwen2-tiny"), ("qwen", "qwen3-tiny"), ("phi", "phi4-mini-tiny"),
            ("mistral", "mistral-tiny"), ("gemma", "gemma2-tiny"), ("gemma", "gemma3-tiny")]


def test_the_runtimes_thread_pool_starts_quietly(default_and_xnnpack):
    """cpuinfo's probing as the runtime's thread pool starts ("Failed to open midr file", ...)
    stays off stderr: the pool starts while a program loads, inside the load's capture
    (llmcore.runtime.program), not at the kernels' first forward call, where it printed
    between an export's stage lines (its parity check) and before ``llmcore run``'s answer.
    In an interpreter of its own: the pool starts once a process."""
    ours, _ = default_and_xnnpack["tiny"]
    code = ("import sys; from llmcore.runtime.program import Program; "
            "Program.load(sys.argv[1]).logits([1, 2, 3], 0); print('ran')")
    done = subprocess.run([sys.executable, "-c", code, str(ours.pte)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ran", done.stderr
    assert "cpuinfo" not in done.stderr, done.stderr


@pytest.mark.parametrize("family", [config for _, config in FAMILIES])
def test_a_recipe_without_plugins_runs_every_layer_on_the_kernels(default_and_xnnpack, family):
    from llmcore.runtime import Program, libraries
    from llmcore_kernels import library

    ours, xnnpack = default_and_xnnpack[family]
    report = ours.report
    assert [b["name"] for b in report["backends"]] == ["kernels", "xnnpack"]
    assert "no --plugins" in report["backends_chosen"]
    (taken,) = report["taken"]
    assert taken["backend"] == "kernels" and taken["left"] == []
    layers = 3 if family == "gemma3-tiny" else 2
    assert taken["taken"] == [f"layers.{i}" for i in range(layers)] + ["norm", "output"]
    ops = libraries.program_operators(ours.pte.read_bytes())
    # q/k norms: the qkv GEMM on int4_linear, the heads normed and rotated after it
    head_norms = family in ("qwen3-tiny", "gemma3-tiny")
    layer_ops = set(SANDWICH_OPS) if family.startswith("gemma") else set(LAYER_OPS[1:])
    layer_ops.add("int4_linear" if head_norms else "int4_norm_qkv_rope")
    assert {f"llmcore::{op}.out" for op in layer_ops} <= set(ops)
    # nothing left for XNNPACK but, with head norms, RoPE's elementwise ops, and Gemma 2's
    # soft-capped attention (its attention module's, in the graph)
    allowed = {"aten_add_Tensor", "aten_sub_Tensor", "aten_mul_Tensor", "aten_cat_default",
               "aten_unsqueeze_copy_default", "aten_view_copy_default"} if head_norms else set()
    if family == "gemma2-tiny":
        allowed |= {"aten_bmm_default", "aten__softmax_default", "aten_tanh_default", "aten_div_Tensor",
                    "aten_mul_Tensor", "aten_add_Tensor", "aten_view_copy_default", "aten_permute_copy_default",
                    "dim_order_ops__clone_dim_order_default"}
    delegated = report["delegation"]["by_backend"].get("XnnpackBackend", {}).get("operators", {})
    assert set(delegated) <= allowed, delegated
    assert report["parity"]["top1_agreement"] == 1.0 and report["parity"]["max_abs_diff"] < 0.05
    # the same integers as 8da4w on XNNPACK alone, whose activations are rounded per token where
    # the kernels round them per block of 32 (csrc/int4_gemm.h): measured 0.010-0.030 apart,
    # each program 0.27 from the float model (int4 on tiny random weights); other integers
    # would put them about that far apart
    assert xnnpack.report["taken"] == [] and xnnpack.report["backends_chosen"] is None
    want = torch.as_tensor(Program.load(xnnpack.pte).logits(IDS, input_pos=0))
    assert not library.own_threads()  # XNNPACK's layers: the kernels (none here) on ExecuTorch's pool
    program = Program.load(ours.pte)
    assert library.own_threads() == (not delegated)  # loaded: as its delegates say
    got = torch.as_tensor(program.logits(IDS, input_pos=0))
    # run: its whole-layer operators moved the kernels to their own threads, delegates or
    # not (runtime/kernels/kernel_threads.h, kernel_threads_for_whole_layers)
    assert library.own_threads()
    assert float((got - want).norm() / want.norm()) < 0.05
    assert int(got.argmax()) == int(want.argmax())


def test_layers_the_kernels_cannot_run_go_to_xnnpack_with_the_reason(kernel_library, tmp_path):
    """8da4w with blocks of 64 (the kernels' are 32): every layer stays with XNNPACK, the
    report says why, and the program answers as the same recipe on XNNPACK alone does."""
    from llmcore.runtime import Program

    options = dict(model="llama", config="tiny", quantize="8da4w", quantize_options={"group_size": 64})
    ours, xnnpack = _export(tmp_path, "ours", **options), _export(tmp_path, "alone", plugins=["xnnpack"], **options)
    (taken,) = ours.report["taken"]
    assert not any(name.startswith("layers.") for name in taken["taken"])
    assert len(taken["left"]) >= 2 and all("blocks are 64 wide" in why for why in taken["left"])
    assert taken["left"][0].startswith("layers.0: ")
    assert ours.report["delegation"]["delegated_subgraphs"] > 0
    want = torch.as_tensor(Program.load(xnnpack.pte).logits(IDS, input_pos=0))
    got = torch.as_tensor(Program.load(ours.pte).logits(IDS, input_pos=0))
    assert float((got - want).norm() / want.norm()) < 0.02


def test_8da8w_gets_the_kernels_integers_unless_the_user_asks_for_the_split(kernel_library, tmp_path):
    """With the kernels first, 8da8w runs without its outlier split (one int8 row per token,
    what the operators take) and says so; a user who sets outlier_split=true keeps it, and
    its layers go to XNNPACK with the reason."""
    default = _export(tmp_path, "int8", model="llama", config="tiny", quantize="8da8w")
    assert default.report["quantization"]["options"]["outlier_split"] is False
    assert "backend 'kernels' runs recipe '8da8w' with outlier_split=False" in default.report["backends_chosen"]
    assert default.report["taken"][0]["taken"][:2] == ["layers.0", "layers.1"]
    split = _export(tmp_path, "int8-split", model="llama", config="tiny", quantize="8da8w",
                    quantize_options={"outlier_split": True})
    (taken,) = split.report["taken"]
    assert "outlier_split=true" in taken["left"][0]
    assert not any(name.startswith("layers.") for name in taken["taken"])
    assert "outlier_split" not in split.report["backends_chosen"]
    on_xnnpack = _export(tmp_path, "int8-xnnpack", model="llama", config="tiny", quantize="8da8w",
                         plugins=["xnnpack"])
    assert on_xnnpack.report["quantization"]["options"]["outlier_split"] is True


def test_the_user_order_stands(kernel_library, tmp_path):
    """--plugins xnnpack leaves the kernels out; --plugins none is the portable runtime; random
    weights without a recipe stay portable."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    portable = _export(tmp_path, "float", model="llama", config="tiny")
    assert portable.report["backends"] == [] and portable.report["backends_chosen"] is None
    named_none = _export(tmp_path, "none", model="llama", config="tiny", quantize="none", plugins=["none"])
    assert named_none.report["backends"] == []
    with pytest.raises(LlmcoreError, match="meant for xnnpack"):
        export(ExportOptions(model="llama", config="tiny", quantize="8da4w", plugins=["none"],
                             output=str(tmp_path / "x.pte"), quiet=True), load_registry())


def test_a_float_model_gives_the_kernels_nothing_and_says_so(kernel_library, tmp_path):
    result = _export(tmp_path, "fp32", model="llama", config="tiny", plugins=["kernels", "xnnpack"])
    (taken,) = result.report["taken"]
    assert taken["taken"] == [] and "no int4 or int8 linears" in taken["note"]
    assert result.report["delegation"]["delegated_subgraphs"] > 0


def test_the_cli_summary_names_the_choice(kernel_library, llmcore_cli, tmp_path):
    out = tmp_path / "m.pte"
    result = llmcore_cli("export", "--model", "gemma", "--config", "gemma2-tiny", "--quantize", "8da4w",
                         "--quantize-option", "group_size=64", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "no --plugins: a recipe exported for this CPU gets kernels,xnnpack" in result.stderr
    assert "backend 'kernels' runs norm and output; leaves 2 to the backends after it: layers.0: its int4 " \
           "blocks are 64 wide" in result.stderr
    report = json.loads(out.with_name("m.report.json").read_text())
    assert report["parity"]["top1_agreement"] == 1.0


@pytest.fixture(scope="module")
def qwen2_q4_0_gguf(tmp_path_factory):
    """A Qwen2-shaped GGUF (q/k/v biases) with every layer matrix in Q4_0, as llama.cpp writes one."""
    import gguf
    from llmcore_llama.testing import GGUF_LAYER_MATRICES, save_random_hf, write_gguf

    folder = tmp_path_factory.mktemp("qwen2-gguf")
    save_random_hf(folder, "Qwen2")
    write_gguf(folder, folder / "q.gguf", quantize=dict.fromkeys(GGUF_LAYER_MATRICES, gguf.GGMLQuantizationType.Q4_0))
    return folder


@pytest.mark.parametrize("split", [False, True], ids=["taken", "left"])
def test_a_gguf_reaches_the_kernels_as_nibbles_and_xnnpack_as_bytes(kernel_library, qwen2_q4_0_gguf, tmp_path,
                                                                     split):
    """Without --plugins, the kernels ask the gguf recipe to hold the int4 integers two to a
    byte (int4_nibbles) until they take the layers; layers they leave (outlier_split=true,
    which their operators do not run) are unpacked for XNNPACK, which lowers them. Either
    way the program answers as the quantized eager model does."""
    folder = qwen2_q4_0_gguf
    options = {"quantize_options": {"outlier_split": True}} if split else {}
    result = _export(tmp_path, "q", checkpoint=str(folder / "q.gguf"), tokenizer=str(folder / "tokenizer.json"),
                     **options)
    report = result.report
    assert report["quantization"]["recipe"] == "gguf"
    assert report["quantization"]["options"]["int4_nibbles"] is True
    assert "int4_nibbles=True" in report["backends_chosen"]
    (taken,) = report["taken"]
    if split:
        assert [name for name in taken["taken"] if name.startswith("layers.")] == []
        assert all("outlier" in why for why in taken["left"]) and len(taken["left"]) >= 2
        assert report["delegation"]["delegated_subgraphs"] >= 2  # the layers, on XNNPACK
        # the integers XNNPACK got are the file's, as on XNNPACK alone (where the outlier split
        # puts the program 0.11 from its eager model on these large random weights)
        from llmcore.runtime import Program

        alone = _export(tmp_path, "alone", checkpoint=str(folder / "q.gguf"),
                        tokenizer=str(folder / "tokenizer.json"), plugins=["xnnpack"], **options)
        want = torch.as_tensor(Program.load(alone.pte).logits(IDS, input_pos=0))
        got = torch.as_tensor(Program.load(result.pte).logits(IDS, input_pos=0))
        assert float((got - want).norm() / want.norm()) < 0.02 and int(got.argmax()) == int(want.argmax())
    else:
        assert taken["left"] == [] and taken["taken"][:2] == ["layers.0", "layers.1"]
        assert report["parity"]["max_abs_diff"] < 0.05
    assert report["parity"]["top1_agreement"] == 1.0


@pytest.mark.parametrize("kind", ["Gemma2", "Gemma3"])
def test_a_gemma_gguf_runs_every_layer_on_the_kernels_by_default(kernel_library, tmp_path, kind):
    """A Q4_0 Gemma 2 (sandwich norms, GeGLU, soft-capped attention and logits) or Gemma 3
    (and q/k norms) GGUF, as llama.cpp's converter writes one, exported as a user does (no
    --plugins, no recipe): the file's integers, every layer on the kernels' post-norm and
    GeGLU operators, the program as its eager model and as the same file on XNNPACK alone."""
    import gguf
    from llmcore.runtime import Program, libraries
    from llmcore_llama.testing import GGUF_LAYER_MATRICES, save_random_hf, write_gguf

    folder = save_random_hf(tmp_path / kind, kind, config_kind="Gemma3Text" if kind == "Gemma3" else "",
                            head_dim=32, query_pre_attn_scalar=32)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(folder, path, quantize=dict.fromkeys(GGUF_LAYER_MATRICES, gguf.GGMLQuantizationType.Q4_0),
               convert=lambda name, t: t + 1.0 if name.endswith("norm.weight") else t)  # Gemma's 1 + w norms
    tokenizer = str(folder / "tokenizer.json")
    ours = _export(tmp_path, "ours", checkpoint=str(path), tokenizer=tokenizer)
    alone = _export(tmp_path, "alone", checkpoint=str(path), tokenizer=tokenizer, plugins=["xnnpack"])
    report = ours.report
    assert report["model"]["family"] == "gemma" and report["quantization"]["recipe"] == "gguf"
    (taken,) = report["taken"]
    # the tied table stays float in the file (as the converter writes a small one): XNNPACK's
    assert taken["left"] == [] and taken["taken"] == ["layers.0", "layers.1", "norm"]
    ops = set(libraries.program_operators(ours.pte.read_bytes()))
    assert {"llmcore::int4_linear_norm_add.out", "llmcore::int4_norm_glu_add.out"} <= ops
    assert report["parity"]["top1_agreement"] == 1.0 and report["parity"]["max_abs_diff"] < 0.05
    # the file's integers on both; activations rounded per block on the kernels, per token on
    # XNNPACK (measured 0.036 apart, both files)
    want = torch.as_tensor(Program.load(alone.pte).logits(IDS, input_pos=0))
    got = torch.as_tensor(Program.load(ours.pte).logits(IDS, input_pos=0))
    assert float((got - want).norm() / want.norm()) < 0.05 and int(got.argmax()) == int(want.argmax())


# The K-quant test models' matrices (width 256, 4 heads of 64, 2 kv heads, MLP 512: whole
# super-blocks of 256), as the GGUF names them.
K_QUANT_SHAPES = {"attn_q.weight": (256, 256), "attn_k.weight": (128, 256), "attn_v.weight": (128, 256),
                  "attn_output.weight": (256, 256), "ffn_gate.weight": (512, 256), "ffn_up.weight": (512, 256),
                  "ffn_down.weight": (256, 512)}


def _k_quant_blocks(types: dict, layers: int, skip: tuple = ()) -> dict:
    """Random K-quant bytes ({gguf name: blocks}) for each layer's matrices, of the type
    ``types`` gives the matrix (write_gguf's ``quantize``), each from its own seed; the names
    in ``skip`` left out (the gguf package quantizes the checkpoint's floats for them)."""
    from llmcore_llama.testing import random_k_blocks

    return {f"blk.{layer}.{matrix}": random_k_blocks(types[matrix], rows, cols, seed=10 * layer + seed, scale=0.002)
            for layer in range(layers) for seed, (matrix, (rows, cols)) in enumerate(K_QUANT_SHAPES.items())
            if f"blk.{layer}.{matrix}" not in skip}


def test_a_q4_k_m_gguf_runs_every_layer_on_the_kernels_its_v_as_int8_rows(kernel_library, tmp_path, caplog):
    """A GGUF quantized as llama.cpp's Q4_K_M is (what most published GGUFs are): Q4_K layers
    with a Q6_K v in some of them (llama.cpp gives half the layers' attn_v more bits). The v
    becomes int8 rows and q and k int4 blocks with offsets, which one projection cannot hold:
    the layer's first operator takes v as a projection of its own, so every layer stays on the
    kernels, and the program answers as its eager model and as the same file on XNNPACK alone."""
    import gguf
    from llmcore.runtime import Program, libraries
    from llmcore_llama.testing import GGUF_LAYER_MATRICES, save_random_hf, write_gguf

    Q = gguf.GGMLQuantizationType
    folder = save_random_hf(tmp_path / "hf", "Qwen2", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2)  # q/k/v biases (Qwen2.5's), widths of whole K-quant blocks
    types = {m: Q.Q4_K for m in GGUF_LAYER_MATRICES}
    types["attn_v.weight"] = Q.Q6_K
    blocks = _k_quant_blocks(types, layers=2)
    path = tmp_path / "q4_k_m.gguf"
    write_gguf(folder, path, quantize=types, extra_tensors=blocks)
    stored = gguf.GGUFReader(str(path))
    assert {t.name: t.tensor_type for t in stored.tensors}["blk.0.attn_v.weight"] == Q.Q6_K
    tokenizer = str(folder / "tokenizer.json")
    with caplog.at_level(logging.WARNING, logger="llmcore_xnnpack.recipes"):
        ours = _export(tmp_path, "ours", checkpoint=str(path), tokenizer=tokenizer)
    alone = _export(tmp_path, "alone", checkpoint=str(path), tokenizer=tokenizer, plugins=["xnnpack"])
    (taken,) = ours.report["taken"]
    assert taken["left"] == [] and taken["taken"][:2] == ["layers.0", "layers.1"]
    assert {f"llmcore::{op}.out" for op in LAYER_OPS} <= set(libraries.program_operators(ours.pte.read_bytes()))
    assert ours.report["parity"]["top1_agreement"] == 1.0 and ours.report["parity"]["max_abs_diff"] < 0.05
    # the Q4_K layers keep their headers: the kernels compute the file's values, where XNNPACK
    # alone takes bfloat16 scales (up to 0.39% off each; test_q4_k.py has the layers alone)
    assert "12 Q4_K kept with its headers" in caplog.text
    want = torch.as_tensor(Program.load(alone.pte).logits(IDS, input_pos=0))
    got = torch.as_tensor(Program.load(ours.pte).logits(IDS, input_pos=0))
    assert float((got - want).norm() / want.norm()) < 0.05 and int(got.argmax()) == int(want.argmax())


def test_layers_whose_weights_differ_in_form_are_lowered_each_as_itself(kernel_library, tmp_path, caplog):
    """A GGUF whose layers differ only in a weight's form: llama.cpp's Q4_K_S gives some
    layers' ffn_down other types than the rest (Q5_K, Q4_K, Q5_0 in SmolLM2's), so one
    layer's MLP operator reads Q4_K nibbles and the next one's int8 rows, with the same
    outputs. Lowering copies later layers from a template layer (llmcore.pipeline.repeated);
    a copy took its template's weight specs, and the export failed at emit ("Tensor spec has
    buffer of size ..."). Each layer now keeps its own, and the program answers as its eager
    model and as the same file on XNNPACK alone."""
    import gguf
    from llmcore.runtime import Program
    from llmcore_llama.testing import GGUF_LAYER_MATRICES, save_random_hf, write_gguf

    Q = gguf.GGMLQuantizationType
    folder = save_random_hf(tmp_path / "hf", "Llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=4)
    types = {m: Q.Q4_K for m in GGUF_LAYER_MATRICES}
    odd = "blk.2.ffn_down.weight"
    types[odd] = Q.Q8_0  # rounded to int8 rows; every other matrix Q4_K, kept with its headers
    blocks = _k_quant_blocks(types, layers=4, skip=(odd,))  # the gguf package quantizes odd's own floats
    path = tmp_path / "mixed.gguf"
    write_gguf(folder, path, quantize=types, extra_tensors=blocks)
    assert {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}[odd] == Q.Q8_0
    tokenizer = str(folder / "tokenizer.json")
    with caplog.at_level(logging.WARNING, logger="llmcore_xnnpack.recipes"):
        ours = _export(tmp_path, "ours", checkpoint=str(path), tokenizer=tokenizer)
    assert "27 Q4_K kept with its headers" in caplog.text and "Q8_0 -> int8 per channel" in caplog.text
    alone = _export(tmp_path, "alone", checkpoint=str(path), tokenizer=tokenizer, plugins=["xnnpack"])
    (taken,) = ours.report["taken"]
    assert taken["left"] == [] and taken["taken"][:4] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert ours.report["parity"]["top1_agreement"] == 1.0 and ours.report["parity"]["max_abs_diff"] < 0.05
    want = torch.as_tensor(Program.load(alone.pte).logits(IDS, input_pos=0))
    got = torch.as_tensor(Program.load(ours.pte).logits(IDS, input_pos=0))
    assert float((got - want).norm() / want.norm()) < 0.05 and int(got.argmax()) == int(want.argmax())


def test_a_q6_k_output_layer_runs_as_the_file_stores_it(kernel_library, tmp_path):
    """An untied output layer stored as Q6_K (Llama-3.1-8B's in a Q4_K_M file): on the kernels
    it keeps the file's super-blocks (the backend's recipe default ``q6_k_output``), where
    XNNPACK alone rounds it to int8 per channel. The program holds the file's bytes, so it is
    smaller than the int8 one by about the table's 1.47 bits a weight, and answers as its eager
    model and as the file's values in fp32."""
    import gguf
    from llmcore.runtime import Program, libraries
    from llmcore_llama.testing import random_k_blocks, save_random_hf, write_gguf

    Q = gguf.GGMLQuantizationType
    folder = save_random_hf(tmp_path / "hf", "Qwen2", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=False)
    path = tmp_path / "q6_k_output.gguf"
    write_gguf(folder, path, quantize={"attn_q.weight": Q.Q4_0, "attn_k.weight": Q.Q4_0, "attn_v.weight": Q.Q4_0,
                                       "attn_output.weight": Q.Q4_0, "ffn_gate.weight": Q.Q4_0,
                                       "ffn_up.weight": Q.Q4_0, "ffn_down.weight": Q.Q4_0, "output.weight": Q.Q6_K},
               extra_tensors={"output.weight": random_k_blocks(Q.Q6_K, 2048, 256, seed=5, scale=0.002)})
    assert {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}["output.weight"] == Q.Q6_K
    tokenizer = str(folder / "tokenizer.json")
    ours = _export(tmp_path, "ours", checkpoint=str(path), tokenizer=tokenizer)
    rounded = _export(tmp_path, "rounded", checkpoint=str(path), tokenizer=tokenizer,
                      quantize_options={"q6_k_output": False})
    floats = _export(tmp_path, "floats", checkpoint=str(path), tokenizer=tokenizer, quantize="none",
                     plugins=["xnnpack"])
    (taken,) = ours.report["taken"]
    assert "output" in taken["taken"] and taken["left"] == []
    assert "llmcore::int4_linear.out" in libraries.program_operators(ours.pte.read_bytes())
    assert ours.report["parity"]["top1_agreement"] == 1.0 and ours.report["parity"]["max_abs_diff"] < 0.05
    int8_bits, q6_k_bits = 2048 * 256 * 8, 2048 * 256 * 6.5625
    saved = ours.report["outputs"]["pte_bytes"] - rounded.report["outputs"]["pte_bytes"]
    assert abs(saved + (int8_bits - q6_k_bits) / 8) < 0.05 * (int8_bits / 8), saved
    # as the same program with the table rounded to int8 per channel (the table's own rounding
    # apart: measured 0.006), and near the file's values in fp32 (the Q4_0 layers' and the
    # activations' rounding on tiny random weights: 0.081 here, 0.06-0.07 over other prompts;
    # test_q6_k.py holds the layer itself to the gguf package's values)
    got = torch.as_tensor(Program.load(ours.pte).logits(IDS, input_pos=0))
    int8_table = torch.as_tensor(Program.load(rounded.pte).logits(IDS, input_pos=0))
    assert float((got - int8_table).norm() / int8_table.norm()) < 0.02 and int(got.argmax()) == int(int8_table.argmax())
    want = torch.as_tensor(Program.load(floats.pte).logits(IDS, input_pos=0))
    assert float((got - want).norm() / want.norm()) < 0.1


def test_a_tied_int8_table_is_stored_once(tmp_path):
    """Llama's tiny config ties its table to the output layer. Under 8da4w on the kernels
    (int8 output layer, 8-bit embedding) the embedding looks its rows up in the integers the
    output layer's operator reads in place (the backend's recipe default ``tied_table``), so
    the program holds the 320 x 64 int8 table once; ``tied_table=false`` gives the embedding
    rows of its own, a second table. Both answer as their eager models."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    sizes = {}
    for options in ({}, {"tied_table": False}):
        out = tmp_path / f"tied-{len(options)}.pte"
        result = export(ExportOptions(model="llama", config="tiny", quantize="8da4w", plugins=["kernels", "xnnpack"],
                                      output=str(out), quiet=True, quantize_options=options), load_registry())
        assert result.report["parity"]["top1_agreement"] == 1.0
        sizes[bool(options)] = result.report["outputs"]["pte_bytes"]
    assert sizes[True] - sizes[False] >= 320 * 64
