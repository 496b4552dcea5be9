"""The bad-input matrix: what a user can get wrong, each answered with one clear line.

Every case runs the CLI as a user would (a subprocess) and checks the same contract:

* a non-zero exit status (2 for an error llmcore explains; 1 would mean an internal error,
  a bug); Ctrl-C ends the process killed by SIGINT (130 in a shell);
* stderr ends with one line ``llmcore: error: [stage/plugin] what was wrong. Fix: ...``
  that names the problem; the lines before it are llmcore's own progress lines (no
  traceback, no library chatter);
* nothing is left behind: the output folder holds no ``.pte``, no report, no tokenizer and
  no ``.partial`` file.

The inputs are built once per module, small and fast: the tiny nanoGPT and tiny Llama
configs, GGUF files written with ``gguf.GGUFWriter``, safetensors in Hugging Face layouts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import resource
import shutil
import signal
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest

from clitools import LLMCORE, run_cli
from fakeplugins import install_fake_distribution
from programs import vulkan_program

EXPORT = ["export", "--model", "nanogpt", "--config", "tiny"]
LLAMA_EXPORT = ["export", "--model", "llama", "--config", "tiny"]

BROKEN_PLUGIN = "raise ImportError('simulated: missing native library libfoo.so')\n"
IMPOSTOR_PLUGIN = """
from llmcore import hookimpl
from llmcore.records import Backend

@hookimpl
def llmcore_partitioners():
    return [Backend(name="xnnpack", description="impostor", partitioners=lambda o: [])]
"""


class Exploit:
    """Unpickling this calls os.system: the payload a malicious checkpoint carries."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---- the inputs ---------------------------------------------------------------------------


def _nanogpt_state():
    from llmcore_nanogpt.model import CONFIGS, GPT

    config = CONFIGS["tiny"]
    return config, GPT(config).init_random(0).state_dict()


CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _write_hf_gpt2(folder: Path, config, state: dict, mutate: Callable[[dict], None]) -> None:
    """A Hugging Face GPT-2 folder (GPT2Model names, Conv1D weights stored [in, out])."""
    from safetensors.torch import save_file

    tensors = {}
    for key, value in state.items():
        if key == "lm_head.weight":
            continue
        key = key.removeprefix("transformer.")
        tensors[key] = (value.t() if key.endswith(CONV1D) else value).contiguous()
    mutate(tensors)
    folder.mkdir()
    hf = {"model_type": "gpt2", "n_positions": config.block_size, "vocab_size": config.vocab_size,
          "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd}
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(folder / "model.safetensors"))


def _llama_state(config):
    """Random tensors with Meta names and the shapes of a llama model of ``config``."""
    import torch

    from llmcore_llama.model import Transformer

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(config).state_dict().items() if not k.startswith("freqs")}
    if config.tie_embeddings:
        shapes.pop("output.weight", None)
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}


def _write_hf_llama(folder: Path, config, mutate: Callable[[dict], None]) -> None:
    from safetensors.torch import save_file

    from llmcore_llama.testing import HF_LAYER_NAMES

    tensors = {}
    for key, value in _llama_state(config).items():
        if key == "tok_embeddings.weight":
            tensors["model.embed_tokens.weight"] = value
        elif key == "norm.weight":
            tensors["model.norm.weight"] = value
        elif key == "output.weight":
            tensors["lm_head.weight"] = value
        else:
            _, i, rest = key.split(".", 2)
            tensors[f"model.layers.{i}.{HF_LAYER_NAMES[rest]}"] = value
    mutate(tensors)
    folder.mkdir()
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.dim,
          "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
          "num_key_value_heads": config.n_kv_heads, "intermediate_size": config.hidden_dim,
          "vocab_size": config.vocab_size, "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
          "max_position_embeddings": config.max_seq_len, "tie_word_embeddings": config.tie_embeddings}
    (folder / "config.json").write_text(json.dumps(hf))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def write_gguf(path: Path, config, *, arch: str = "llama", raw: Optional[dict] = None) -> None:
    """A llama GGUF of ``config`` with F32 tensors; ``raw`` maps Meta tensor names to
    ``(ggml type, uint8 blocks)`` stored as they are."""
    from llmcore_llama.testing import write_llama_gguf

    write_llama_gguf(path, _llama_state(config), config, arch=arch, raw=raw)


def _q8_k_blocks(rows: int, cols: int):
    """Q8_K bytes: a type neither the llama plugin nor gguf.quants dequantizes (Q2_K, once
    refused here, now goes through gguf.quants)."""
    import gguf
    import numpy as np

    values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]
    blocks = np.random.default_rng(0).integers(0, 256, size=(rows, cols // values * nbytes), dtype=np.uint8)
    return gguf.GGMLQuantizationType.Q8_K, blocks


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, exports) -> Path:
    """Every bad input of the matrix, in one folder."""
    from llmcore_llama.config import CONFIGS as LLAMA

    fx = tmp_path_factory.mktemp("bad-inputs")

    # recipes
    (fx / "unknown-key.yaml").write_text("model: nanogpt\nconfig: tiny\nbogus_key: 1\n")
    (fx / "wrong-type.yaml").write_text("model: nanogpt\nconfig: tiny\nmax-seq-len: lots\n")
    (fx / "malformed.yaml").write_text("model: nanogpt\nplugins: [xnnpack\nconfig: tiny\n")
    (fx / "list.yaml").write_text("- model\n- nanogpt\n")

    # nanoGPT checkpoints
    config, state = _nanogpt_state()
    import torch

    torch.save({"model_args": dataclasses.asdict(config), "model": state}, fx / "ckpt.pt")
    data = (fx / "ckpt.pt").read_bytes()
    (fx / "truncated").mkdir()
    (fx / "truncated" / "ckpt.pt").write_bytes(data[: len(data) // 2])
    (fx / "exploit").mkdir()
    with open(fx / "exploit" / "ckpt.pt", "wb") as f:
        pickle.dump({"model_args": {}, "model": Exploit(fx / "pwned")}, f)
    (fx / "notes.txt").write_text("not a checkpoint\n")

    _write_hf_gpt2(fx / "gpt2-missing", config, state, lambda t: t.pop("h.1.mlp.c_fc.weight"))
    _write_hf_gpt2(fx / "gpt2-extra", config, state, lambda t: t.update({"h.7.attn.c_attn.weight": t["h.0.attn.c_attn.weight"].clone()}))
    _write_hf_gpt2(fx / "gpt2-shape", config, state, lambda t: t.update({"h.0.mlp.c_fc.weight": torch.zeros(64, 100)}))
    _write_hf_gpt2(fx / "gpt2-truncated", config, state, lambda t: None)
    weights = fx / "gpt2-truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40_000])

    # Llama checkpoints
    tiny = LLAMA["tiny"]
    _write_hf_llama(fx / "llama-missing", tiny, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _write_hf_llama(fx / "llama-extra", tiny, lambda t: t.update({"model.layers.1.self_attn.q_proj.bias": torch.zeros(64)}))
    _write_hf_llama(fx / "llama-shape", tiny, lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 100)}))
    write_gguf(fx / "llama.gguf", tiny)
    gguf_bytes = (fx / "llama.gguf").read_bytes()
    (fx / "truncated.gguf").write_bytes(gguf_bytes[: len(gguf_bytes) // 2])
    (fx / "truncated-header.gguf").write_bytes(gguf_bytes[:100])
    # an array of 2**62 bytes that the file does not hold: gguf's own reader loops on it for ever
    (fx / "huge-array.gguf").write_bytes(
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"x" + struct.pack("<IIQ", 9, 0, 2**62)
    )
    write_gguf(fx / "gpt2-arch.gguf", tiny, arch="gpt2")
    wide = dataclasses.replace(tiny, dim=256, n_heads=4, n_kv_heads=2, hidden_dim=512)
    write_gguf(fx / "q8k.gguf", wide, raw={"layers.0.feed_forward.w2.weight": _q8_k_blocks(256, 512)})

    # tokenizers
    (fx / "bad-merges").mkdir()
    (fx / "bad-merges" / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (fx / "bad-merges" / "merges.txt").write_text("#version: 0.2\na b c\n")
    (fx / "truncated-tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [')
    (fx / "not-a-tokenizer.json").write_text('{"hello": "world"}')
    (fx / "garbage.model").write_bytes(bytes(range(256)) * 3)

    # programs
    good = exports("portable")
    (fx / "good").mkdir()
    shutil.copy(good.pte, fx / "good" / "tiny.pte")
    shutil.copy(good.tokenizer_path, fx / "good" / "tokenizer.json")
    (fx / "no-tokenizer").mkdir()
    shutil.copy(good.pte, fx / "no-tokenizer" / "tiny.pte")
    (fx / "corrupt-tokenizer").mkdir()
    shutil.copy(good.pte, fx / "corrupt-tokenizer" / "tiny.pte")
    (fx / "corrupt-tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    program = good.pte.read_bytes()
    (fx / "programs").mkdir()
    shutil.copy(good.tokenizer_path, fx / "programs" / "tokenizer.json")
    (fx / "programs" / "truncated.pte").write_bytes(program[: len(program) // 2])
    (fx / "programs" / "header-only.pte").write_bytes(program[:6])
    (fx / "programs" / "notes.pte").write_text("hello, I am not a program\n")
    vulkan_program(fx / "programs" / "vulkan.pte")

    # nested 100,000 levels deep (llmcore/nesting.py)
    deep = "[" * 100_000 + "]" * 100_000
    (fx / "deep").mkdir()
    (fx / "deep" / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": 0}, "x": ' + deep + "}}")
    (fx / "deep" / "schema.json").write_text('{"type": "object", "x": ' + deep + "}")
    (fx / "deep.yaml").write_text("model: nanogpt\nconfig: tiny\ntransforms: " + deep + "\n")
    for name, source, model_type in (("llama-deep-config", "llama-missing", "llama"),
                                     ("gpt2-deep-config", "gpt2-missing", "gpt2")):
        shutil.copytree(fx / source, fx / name)
        (fx / name / "config.json").write_text('{"model_type": "%s", "x": %s}' % (model_type, deep))
    (fx / "deep-config").mkdir()
    shutil.copy(good.pte, fx / "deep-config" / "tiny.pte")
    shutil.copy(good.tokenizer_path, fx / "deep-config" / "tokenizer.json")
    (fx / "deep-config" / "tokenizer_config.json").write_text('{"chat_template": ' + deep + "}")

    # chat templates
    (fx / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }")

    # plugins installed as distributions
    install_fake_distribution(fx / "site-broken", "llmcore-broken", "broken", "llmcore_broken", BROKEN_PLUGIN)
    install_fake_distribution(fx / "site-impostor", "llmcore-impostor", "impostor", "llmcore_impostor", IMPOSTOR_PLUGIN)
    return fx


# ---- the matrix ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    """``{fx}`` is the inputs folder, ``{out}`` the (empty) output folder."""
    expect: tuple[str, ...]
    """Substrings of the error line: what was wrong, in the user's terms."""
    env: dict = field(default_factory=dict)
    how: str = "plain"
    """plain | fsize (a file-size limit: the disk fills while writing) | sigint | immutable"""


def case(id, args, *expect, env=None, how="plain"):
    return pytest.param(Case(id, tuple(args), expect, env or {}, how), id=id)


MATRIX = [
    # plugins and names
    case("unknown-backend", [*EXPORT, "--plugins", "nosuch"], "unknown backend 'nosuch'", "xnnpack"),
    case("plugin-fails-to-import", [*EXPORT, "--plugins", "broken"], "'broken'", "failed to import", "libfoo.so",
         env={"PYTHONPATH": "{fx}/site-broken"}),
    case("allowlist-names-a-missing-plugin", [*EXPORT, "--plugins", "npu"], "backend 'npu' is unavailable",
         "not installed", env={"LLMCORE_LOAD_PLUGINS": "nanogpt,xnnpack,npu"}),
    case("two-plugins-one-backend", [*EXPORT, "--plugins", "xnnpack"], "more than one plugin",
         "llmcore-impostor", "llmcore-xnnpack", env={"PYTHONPATH": "{fx}/site-impostor"}),
    case("unknown-model-family", ["export", "--model", "gpt5", "-o", "{out}/x.pte"], "unknown model family 'gpt5'",
         "nanogpt"),
    case("model-family-as-backend", [*EXPORT, "--plugins", "nanogpt"], "is a model family, not a backend"),
    case("unknown-config", ["export", "--model", "nanogpt", "--config", "huge"], "has no config 'huge'", "tiny"),
    case("unknown-quantizer", [*EXPORT, "--plugins", "xnnpack", "--quantize", "int3"], "unknown quantizer recipe 'int3'"),
    case("unknown-transform", [*EXPORT, "--transforms", "flash"], "unknown source transform 'flash'"),
    # recipes
    case("recipe-unknown-key", ["export", "--recipe", "{fx}/unknown-key.yaml"], "unknown key 'bogus_key'"),
    case("recipe-wrong-type", ["export", "--recipe", "{fx}/wrong-type.yaml"], "'max_seq_len' must be an integer"),
    case("recipe-malformed-yaml", ["export", "--recipe", "{fx}/malformed.yaml"], "not valid YAML at line"),
    case("recipe-not-a-mapping", ["export", "--recipe", "{fx}/list.yaml"], "must be a YAML mapping"),
    case("recipe-missing", ["export", "--recipe", "{fx}/nosuch.yaml"], "cannot read recipe", "No such file"),
    case("bad-key-value-flag", [*EXPORT, "--quantize-option", "group_size"], "expects KEY=VALUE"),
    # quantizer and backend options
    case("quantizer-for-another-backend", [*EXPORT, "--plugins", "none", "--quantize", "int8-dynamic"], "meant for xnnpack"),
    case("quantizer-unknown-option", [*EXPORT, "--plugins", "xnnpack", "--quantize", "int8-dynamic",
                                      "--quantize-option", "bits=3"], "has no option 'bits'", "per_channel"),
    case("backend-unknown-option", [*EXPORT, "--plugins", "xnnpack", "--backend-option", "xnnpack.bogus=1"],
         "has no option 'bogus'", "per_op_mode"),
    case("backend-option-wrong-type", [*EXPORT, "--plugins", "xnnpack", "--backend-option",
                                       "xnnpack.per_op_mode=often"], "'per_op_mode'", "must be bool"),
    case("backend-option-unselected", [*EXPORT, "--backend-option", "xnnpack.per_op_mode=true"],
         "not in --plugins"),
    # checkpoints
    case("checkpoint-missing", ["export", "--model", "nanogpt", "--checkpoint", "{fx}/nosuch.pt"], "does not exist"),
    case("checkpoint-unrecognised", ["export", "--model", "nanogpt", "--checkpoint", "{fx}/notes.txt"],
         "no loader of model family 'nanogpt' recognises"),
    case("checkpoint-truncated", ["export", "--model", "nanogpt", "--checkpoint", "{fx}/truncated/ckpt.pt"],
         "truncated"),
    case("checkpoint-runs-code", ["export", "--model", "nanogpt", "--checkpoint", "{fx}/exploit/ckpt.pt"],
         "refused to load", "posix.system"),
    case("gpt2-safetensors-missing-tensor", ["export", "--model", "nanogpt", "--checkpoint", "{fx}/gpt2-missing"],
         "missing 1 tensor(s): transformer.h.1.mlp.c_fc.weight"),
    case("gpt2-safetensors-extra-tensor", ["export", "--model", "nanogpt", "--checkpoint", "{fx}/gpt2-extra"],
         "unexpected 1 tensor(s): transformer.h.7.attn.c_attn.weight"),
    case("gpt2-safetensors-wrong-shape", ["export", "--model", "nanogpt", "--checkpoint", "{fx}/gpt2-shape"],
         "wrong shape", "transformer.h.0.mlp.c_fc.weight"),
    case("gpt2-safetensors-truncated", ["export", "--model", "nanogpt", "--checkpoint", "{fx}/gpt2-truncated"],
         "model.safetensors", "not a readable safetensors file"),
    case("llama-safetensors-missing-tensor", ["export", "--model", "llama", "--checkpoint", "{fx}/llama-missing"],
         "missing", "model.layers.1.mlp.up_proj.weight"),
    case("llama-safetensors-extra-tensor", ["export", "--model", "llama", "--checkpoint", "{fx}/llama-extra"],
         "unexpected", "model.layers.1.self_attn.q_proj.bias"),
    case("llama-safetensors-wrong-shape", ["export", "--model", "llama", "--checkpoint", "{fx}/llama-shape"],
         "wrong shape", "model.layers.0.mlp.down_proj.weight", "[64, 100]", "[64, 192]"),
    case("gguf-truncated", ["export", "--model", "llama", "--checkpoint", "{fx}/truncated.gguf"], "truncated"),
    case("gguf-truncated-header", ["export", "--model", "llama", "--checkpoint", "{fx}/truncated-header.gguf"],
         "truncated"),
    case("gguf-huge-array-length", ["export", "--model", "llama", "--checkpoint", "{fx}/huge-array.gguf"],
         "huge-array.gguf is truncated", "4611686018427387904 values"),
    case("gguf-other-architecture", ["export", "--model", "llama", "--checkpoint", "{fx}/gpt2-arch.gguf"],
         "holds a 'gpt2' model, not llama"),
    case("gguf-unsupported-tensor-type", ["export", "--model", "llama", "--checkpoint", "{fx}/q8k.gguf"],
         "'blk.0.ffn_down.weight' is stored as Q8_K"),
    case("gguf-without-tokenizer", ["export", "--model", "llama", "--checkpoint", "{fx}/llama.gguf"],
         "found no tokenizer", "--tokenizer"),
    # tokenizers
    case("tokenizer-missing", [*EXPORT, "--tokenizer", "{fx}/nosuch"], "tokenizer", "does not exist"),
    case("tokenizer-corrupt-merges", [*EXPORT, "--tokenizer", "{fx}/bad-merges"], "merges.txt",
         "a merge line must hold two symbols"),
    case("tokenizer-truncated-json", [*EXPORT, "--tokenizer", "{fx}/truncated-tokenizer.json"],
         "truncated-tokenizer.json"),
    case("tokenizer-not-a-tokenizer", [*EXPORT, "--tokenizer", "{fx}/not-a-tokenizer.json"],
         "not-a-tokenizer.json", "tokenizer.json"),
    case("llama-tokenizer-truncated-json", [*LLAMA_EXPORT, "--tokenizer", "{fx}/truncated-tokenizer.json"],
         "is not a Hugging Face tokenizer.json"),
    case("llama-tokenizer-garbage", [*LLAMA_EXPORT, "--tokenizer", "{fx}/garbage.model"],
         "garbage.model", "not a SentencePiece model"),
    # lengths
    case("max-seq-len-too-long", [*EXPORT, "--max-seq-len", "4096"], "beyond what the model supports (128)"),
    case("max-seq-len-too-short", [*EXPORT, "--max-seq-len", "1"], "max-seq-len must be at least 2"),
    case("run-prompt-longer-than-context", ["run", "{fx}/good/tiny.pte", "--prompt", "many words " * 20],
         "the prompt has 220 tokens", "at most 128"),
    # the output
    case("output-folder-missing", ["export", "--model", "nanogpt", "--config", "tiny", "-o", "{out}/no/x.pte"],
         "does not exist"),
    case("output-parent-is-a-file", ["export", "--model", "nanogpt", "--config", "tiny", "-o", "{fx}/notes.txt/x.pte"],
         "is not a folder"),
    case("output-folder-read-only", [*EXPORT], "is not writable", how="immutable"),
    case("output-not-pte", ["export", "--model", "nanogpt", "--config", "tiny", "-o", "{out}/x.bin"],
         "should end in .pte"),
    case("disk-fills-while-writing", [*EXPORT], "could not write", "file-size limit", how="fsize"),
    case("ctrl-c-during-lower", [*EXPORT], "interrupted", how="sigint"),
    # programs
    case("run-truncated-pte", ["run", "{fx}/programs/truncated.pte", "--prompt", "hi"], "truncated"),
    case("inspect-truncated-pte", ["inspect", "{fx}/programs/truncated.pte"], "is truncated"),
    case("run-header-only-pte", ["run", "{fx}/programs/header-only.pte", "--prompt", "hi"],
         "not an ExecuTorch program"),
    case("run-needs-missing-backend", ["run", "{fx}/programs/vulkan.pte", "--prompt", "hi"],
         "needs backend VulkanBackend"),
    case("run-not-a-pte", ["run", "{fx}/programs/notes.pte", "--prompt", "hi"], "not an ExecuTorch program"),
    case("inspect-not-a-pte", ["inspect", "{fx}/programs/notes.pte"], "not an ExecuTorch program"),
    case("run-missing-pte", ["run", "{fx}/programs/nosuch.pte", "--prompt", "hi"], "does not exist"),
    case("run-missing-tokenizer", ["run", "{fx}/no-tokenizer/tiny.pte", "--prompt", "hi"], "tokenizer.json",
         "No such file"),
    case("run-corrupt-tokenizer", ["run", "{fx}/corrupt-tokenizer/tiny.pte", "--prompt", "hi"],
         "not a valid tokenizer.json"),
    # documents nested past the limit (Python's parsers recursed into a RecursionError)
    case("tokenizer-json-too-deep", [*EXPORT, "--tokenizer", "{fx}/deep/tokenizer.json"], "deep/tokenizer.json",
         "more than 512 deep"),
    case("llama-tokenizer-json-too-deep", [*LLAMA_EXPORT, "--tokenizer", "{fx}/deep/tokenizer.json"],
         "deep/tokenizer.json", "more than 512 deep"),
    case("llama-config-too-deep", ["export", "--model", "llama", "--checkpoint", "{fx}/llama-deep-config"],
         "llama-deep-config/config.json", "more than 512 deep"),
    case("gpt2-config-too-deep", ["export", "--model", "nanogpt", "--checkpoint", "{fx}/gpt2-deep-config"],
         "gpt2-deep-config/config.json", "more than 512 deep"),
    case("checkpoint-config-too-deep", ["export", "--checkpoint", "{fx}/llama-deep-config"],
         "llama-deep-config/config.json", "more than 512 deep"),
    case("recipe-too-deep", ["export", "--recipe", "{fx}/deep.yaml"], "deep.yaml", "deeper than its parser can follow"),
    case("run-json-schema-too-deep", ["run", "{fx}/good/tiny.pte", "--prompt", "hi", "--json-schema",
                                      "{fx}/deep/schema.json"], "--json-schema", "more than 512 deep"),
    case("run-chat-tokenizer-config-too-deep", ["run", "{fx}/deep-config/tiny.pte", "--chat", "--prompt", "hi"],
         "deep-config/tokenizer_config.json", "more than 512 deep"),
    # chat templates (--chat-template)
    case("chat-template-unknown-name", ["run", "{fx}/good/tiny.pte", "--chat-template", "chatlm", "--prompt", "hi"],
         "--chat-template 'chatlm'", "chatml, llama3, zephyr"),
    case("chat-template-missing-file", ["serve", "{fx}/good/tiny.pte", "--chat-template", "{fx}/nosuch.jinja"],
         "nosuch.jinja", "neither a built-in template nor a file"),
    case("chat-template-does-not-compile", ["chat", "{fx}/good/tiny.pte", "--chat-template", "{fx}/broken.jinja"],
         "broken.jinja", "not a Jinja template", "line 1"),
    case("export-chat-template-unknown", [*EXPORT, "--chat-template", "nosuch"], "--chat-template 'nosuch'"),
]


def _fill(text: str, fx: Path, out: Path) -> str:
    return text.replace("{fx}", str(fx)).replace("{out}", str(out))


def _argv(c: Case, fx: Path, out: Path) -> list[str]:
    args = [_fill(a, fx, out) for a in c.args]
    if args[0] == "export" and "-o" not in args:
        args += ["-o", str(out / "x.pte")]
    return args


def _env(c: Case, fx: Path) -> dict:
    env = {k: _fill(v, fx, fx) for k, v in c.env.items()}
    if "PYTHONPATH" in env and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    return env


def _run_with_file_size_limit(argv: list[str], env: dict, limit: int) -> subprocess.CompletedProcess:
    """The disk fills: writes past ``limit`` bytes fail with EFBIG (SIGXFSZ ignored)."""

    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    # No bytecode caches: a .pyc cut short by the limit would be left in the shared venv.
    env = {**os.environ, **env, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([*LLMCORE, *argv], capture_output=True, text=True, env=env, preexec_fn=preexec, timeout=600)


def _interrupt_at(argv: list[str], env: dict, stage: str) -> subprocess.CompletedProcess:
    """Start the export, wait for it to announce ``stage``, press Ctrl-C (SIGINT)."""
    proc = subprocess.Popen([*LLMCORE, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if line.startswith(f"[llmcore] {stage} ..."):
                time.sleep(0.2)
                proc.send_signal(signal.SIGINT)
                break
        stdout, rest = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert any(line.startswith(f"[llmcore] {stage} ...") for line in seen), "".join(seen)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "".join(seen) + rest)


def _immutable(folder: Path) -> bool:
    """Make ``folder`` immutable (refused even to root); False where chattr cannot."""
    if shutil.which("chattr") is None:
        return False
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    return done.returncode == 0


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.is_dir() else []


@pytest.mark.parametrize("c", MATRIX)
def test_bad_input_gets_one_line_and_leaves_nothing(c: Case, inputs: Path, tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    argv, env = _argv(c, inputs, out), _env(c, inputs)
    before = _files(inputs)
    if c.how == "plain":
        result = run_cli(*argv, env=env)
    elif c.how == "fsize":
        result = _run_with_file_size_limit(argv, env, limit=100_000)  # the tiny .pte is ~550 KB
    elif c.how == "sigint":
        result = _interrupt_at(argv, env, "lower")
    elif c.how == "immutable":
        if not _immutable(out):
            pytest.skip("chattr +i is not available here (the missing-folder and parent-is-a-file cases stand in)")
        try:
            result = run_cli(*argv, env=env)
        finally:
            subprocess.run(["chattr", "-i", str(out)], check=True)
    else:
        raise AssertionError(c.how)

    lines = result.stderr.strip().splitlines()
    assert lines, f"no output on stderr (exit {result.returncode})"
    last = lines[-1]
    print(f"{c.id} (exit {result.returncode}): {last}")
    context = f"exit {result.returncode}, stderr:\n{result.stderr[-3000:]}"
    if c.how == "sigint":
        assert result.returncode == -signal.SIGINT, context  # killed by SIGINT: 130 in a shell
        assert last.startswith("llmcore: interrupted"), context
        assert any(line.startswith("[llmcore] Ctrl-C: stopping at the end of this step") for line in lines), context
    else:
        assert result.returncode == 2, context  # 1 would be an internal error: a bug
        assert last.startswith("llmcore: error: "), context
        assert " Fix: " in last, context
    for expected in c.expect:
        assert expected in last, f"{expected!r} not in the error line; {context}"
    assert "Traceback" not in result.stderr, context
    noise = [line for line in lines[:-1] if not line.startswith("[llmcore] ")]
    assert not noise, f"stderr has more than llmcore's progress and its one error line: {context}"
    assert _files(out) == [], f"left behind: {_files(out)}"
    assert _files(inputs) == before, "the inputs folder changed"
    assert not (inputs / "pwned").exists(), "the checkpoint's pickle ran code"


def test_debug_shows_the_traceback_of_a_matrix_error(inputs, tmp_path):
    result = run_cli("--debug", "export", "--model", "nanogpt", "--checkpoint", str(inputs / "truncated" / "ckpt.pt"),
                     "-o", str(tmp_path / "x.pte"))
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("llmcore: error: ")


def test_the_matrix_is_large_enough():
    assert len(MATRIX) >= 30


# ---- the write stage, in-process ----------------------------------------------------------


def _bundle(folder: Path):
    from llmcore.pipeline.write import OutputBundle

    bundle = OutputBundle()
    bundle.stage(folder / "m.pte", b"ET12" * 1000)
    bundle.stage(folder / "tokenizer.json", "{}")
    bundle.stage(folder / "m.report.json", "{}")
    return bundle


def test_a_rename_failing_midway_takes_back_the_renamed_files(tmp_path, monkeypatch):
    import errno as errnos

    from llmcore.errors import LlmcoreError

    bundle = _bundle(tmp_path)
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append(Path(dst).name)
        if len(calls) == 2:
            raise OSError(errnos.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(LlmcoreError, match="nothing was written"):
        bundle.commit()
    assert calls[-1] != "m.pte"  # the .pte is renamed last
    assert _files(tmp_path) == []


def test_ctrl_c_during_the_commit_leaves_nothing(tmp_path, monkeypatch):
    bundle = _bundle(tmp_path)
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "tokenizer.json":
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        bundle.commit()
    assert _files(tmp_path) == []


def test_a_full_disk_names_the_file_and_the_fix(tmp_path, monkeypatch):
    import builtins
    import errno as errnos

    from llmcore.errors import LlmcoreError
    from llmcore.pipeline.write import OutputBundle

    real_open = builtins.open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errnos.ENOSPC, "No space left on device")

    monkeypatch.setattr(builtins, "open", lambda p, mode="r", *a, **k: FullDisk(real_open(p, mode, *a, **k))
                        if str(p).endswith(".partial") and "w" in mode else real_open(p, mode, *a, **k))
    bundle = OutputBundle()
    with pytest.raises(LlmcoreError) as caught:
        bundle.stage(tmp_path / "m.pte", b"ET12" * 1000)
    assert "No space left on device" in caught.value.message and "free some disk space" in caught.value.fix
    assert _files(tmp_path) == []


def test_outputs_get_the_usual_file_mode(tmp_path):
    previous = os.umask(0o022)
    try:
        _bundle(tmp_path).commit()
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"m.pte": 0o644, "tokenizer.json": 0o644, "m.report.json": 0o644}
