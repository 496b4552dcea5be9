"""The nanoGPT / GPT-2 plugin: its LayerNorm, the split-qkv transform, its loaders, an export.

Every model here is a small random-weight GPT built in the test; nothing touches the network.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmcore.errors import LlmcoreError
from llmcore.records import LoadOptions, SourceTransform

from llmcore_nanogpt import loaders
from llmcore_nanogpt.model import CONFIGS, GPT, GPTConfig, LayerNorm, SelfAttention, SplitQKV, split_qkv

LENGTHS = (1, 2, 7, 33, 128)  # 128 is the tiny config's block_size


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def _tiny(seed: int = 0, config: GPTConfig = CONFIGS["tiny"]) -> GPT:
    """A GPT whose every parameter is random, LayerNorm weights and biases included.

    ``init_random`` leaves biases at 0 and norm weights at 1, which would hide a loader that
    swaps or drops them; perturbing everything makes each tensor's place count.
    """
    model = GPT(config).init_random(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def _tokens(length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed + length))


def _logits(model: torch.nn.Module, length: int) -> torch.Tensor:
    with torch.no_grad():
        return model(_tokens(length, model.config.vocab_size))


# ---- LayerNorm ------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 64), (2, 7, 64), (1, 1, 64)])
def test_layer_norm_matches_torch(bias, shape):
    norm = LayerNorm(64, bias=bias)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
        if bias:
            norm.bias.copy_(torch.randn(64))
    assert (norm.bias is None) == (not bias)
    x = torch.randn(shape) * 3 + 1.5  # off-centre, not unit variance
    got = norm(x)
    expected = F.layer_norm(x, (64,), norm.weight, norm.bias, 1e-5)
    assert got.shape == x.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_layer_norm_is_per_row():
    # Rows on wildly different scales: a norm that pooled over the wrong axes would mix them.
    norm = LayerNorm(16, bias=True)
    x = torch.randn(3, 4, 16) * torch.tensor([1e-2, 1.0, 1e2]).view(3, 1, 1)
    torch.testing.assert_close(norm(x), F.layer_norm(x, (16,), norm.weight, norm.bias, 1e-5), atol=1e-5, rtol=0)


# ---- split-qkv ------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_split_qkv_keeps_logits(bias):
    config = dataclasses.replace(CONFIGS["tiny"], bias=bias)
    model = _tiny(config=config)
    before = {n: _logits(model, n) for n in LENGTHS}

    assert split_qkv(model) == config.n_layer
    attns = [m for m in model.modules() if isinstance(m, SelfAttention)]
    assert len(attns) == config.n_layer and all(isinstance(a.c_attn, SplitQKV) for a in attns)
    for a in attns:
        assert (a.c_attn.q.bias is None) == (not bias)
        assert a.c_attn.q.weight.shape == (config.n_embd, config.n_embd)

    for n in LENGTHS:
        torch.testing.assert_close(_logits(model, n), before[n], atol=1e-5, rtol=0)

    assert split_qkv(model) == 0  # already split: nothing left to do
    torch.testing.assert_close(_logits(model, 7), before[7], atol=1e-5, rtol=0)


def test_split_qkv_rows_are_q_k_v_in_order():
    model = _tiny()
    fused = model.transformer.h[0].attn.c_attn
    w, b = fused.weight.detach().clone(), fused.bias.detach().clone()
    split_qkv(model)
    split = model.transformer.h[0].attn.c_attn
    width = model.config.n_embd
    for i, proj in enumerate((split.q, split.k, split.v)):
        assert torch.equal(proj.weight, w[i * width:(i + 1) * width])
        assert torch.equal(proj.bias, b[i * width:(i + 1) * width])
        assert proj.weight.device.type == "cpu"


def test_source_transform_hook():
    import llmcore_nanogpt

    transforms = llmcore_nanogpt.llmcore_source_transforms()
    by_name = {t.name: t for t in transforms}
    assert "split-qkv" in by_name
    t = by_name["split-qkv"]
    assert isinstance(t, SourceTransform)
    assert t.automatic is True
    assert t.families == ("nanogpt",) and t.backends == ("xnnpack",)

    model = _tiny()
    before = _logits(model, 9)
    out = t.apply(model, None)
    assert isinstance(out.transformer.h[1].attn.c_attn, SplitQKV)
    torch.testing.assert_close(_logits(out, 9), before, atol=1e-5, rtol=0)


# ---- loaders --------------------------------------------------------------------------------


def _save_nanogpt(model: GPT, folder: Path, prefix: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    state = {prefix + k: v.clone() for k, v in model.state_dict().items()}
    torch.save({"model_args": dataclasses.asdict(model.config), "model": state, "iter_num": 7}, folder / "ckpt.pt")
    return folder / "ckpt.pt"


def _hf_state(model: GPT, prefix: str = "transformer.", mask_buffers: bool = False) -> dict[str, torch.Tensor]:
    """The state dict as HF GPT-2 stores it: Conv1D weights as [in, out], lm_head tied away."""
    state = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        if key.endswith(loaders.CONV1D_SUFFIXES):
            value = value.t()
        state[prefix + key.removeprefix("transformer.")] = value.contiguous().clone()
    if mask_buffers:  # what older transformers versions saved for the causal mask
        n = model.config.block_size
        for i in range(model.config.n_layer):
            state[f"{prefix}h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
            state[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return state


def _save_hf(model: GPT, folder: Path, fmt: str = "safetensors", **kwargs) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    c = model.config
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": c.vocab_size,
        "n_positions": c.block_size,
        "n_ctx": c.block_size,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    state = _hf_state(model, **kwargs)
    if fmt == "safetensors":
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder


def _assert_same_logits(loaded: torch.nn.Module, original: GPT):
    assert loaded.config.n_layer == original.config.n_layer
    assert loaded.config.vocab_size == original.config.vocab_size
    assert loaded.config.block_size == original.config.block_size
    for n in (1, 5, 64):
        torch.testing.assert_close(_logits(loaded, n), _logits(original, n), atol=1e-5, rtol=0)


@pytest.mark.parametrize("prefix", ["", "_orig_mod."])
def test_load_nanogpt_ckpt(tmp_path, prefix):
    original = _tiny(seed=5)
    file = _save_nanogpt(original, tmp_path / "run", prefix)
    for path in (file, file.parent):  # the file or its folder
        assert loaders.matches_nanogpt(path)
        loaded = loaders.load_nanogpt(path, LoadOptions(), None)
        _assert_same_logits(loaded.module, original)
    assert loaded.module.lm_head.weight is loaded.module.transformer.wte.weight


def test_unknown_model_args_are_refused_by_name(tmp_path):
    """A fork's extra model_args key may change the math: refused, not dropped."""
    original = _tiny(seed=7)
    file = _save_nanogpt(original, tmp_path)
    data = torch.load(file, weights_only=True)
    data["model_args"]["rope_theta"] = 10000.0
    torch.save(data, file)
    with pytest.raises(LlmcoreError, match=r"model_args rope_theta is not part of nanoGPT's GPTConfig") as info:
        loaders.load_nanogpt(file, LoadOptions(), None)
    assert info.value.plugin == "nanogpt" and info.value.fix


def test_load_nanogpt_ckpt_no_bias(tmp_path):
    original = _tiny(seed=6, config=dataclasses.replace(CONFIGS["tiny"], bias=False, n_layer=1))
    file = _save_nanogpt(original, tmp_path)
    loaded = loaders.load_nanogpt(file, LoadOptions(), None)
    assert loaded.module.config.bias is False
    _assert_same_logits(loaded.module, original)


@pytest.mark.parametrize(
    "fmt, kwargs",
    [
        ("safetensors", {}),
        ("safetensors", {"prefix": "", "mask_buffers": True}),  # GPT2Model names, as on the Hub
        ("bin", {}),
    ],
    ids=["safetensors", "safetensors-bare-names", "pytorch_model.bin"],
)
def test_load_hf_gpt2(tmp_path, fmt, kwargs):
    original = _tiny(seed=7)
    folder = _save_hf(original, tmp_path / "hf", fmt, **kwargs)
    assert loaders.matches_hf(folder) and not loaders.matches_nanogpt(folder)
    loaded = loaders.load_hf(folder, LoadOptions(), None)
    _assert_same_logits(loaded.module, original)


def test_load_hf_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    original = _tiny(seed=8)
    folder = _save_hf(original, tmp_path / "hf")
    ours = loaders.load_hf(folder, LoadOptions(), None).module
    ref = transformers.GPT2LMHeadModel.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    for n in (1, 6, 40, 128):
        tokens = _tokens(n, original.config.vocab_size)
        with torch.no_grad():
            expected = ref(tokens).logits[:, -1, :]
            got = ours(tokens)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("key, value", [("activation_function", "relu"), ("n_inner", 100),
                                        ("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False)])
def test_hf_keys_that_change_the_math_are_refused_by_name(tmp_path, key, value):
    folder = _save_hf(_tiny(seed=9), tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {key: value}))
    with pytest.raises(LlmcoreError, match=f"{key}={value!r}"):
        loaders.load_hf(folder, LoadOptions(), None)


def test_hf_layer_norm_epsilon_is_applied(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = _save_hf(_tiny(seed=10), tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"layer_norm_epsilon": 0.5}))
    ours = loaders.load_hf(folder, LoadOptions(), None).module
    ref = transformers.GPT2LMHeadModel.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    tokens = _tokens(12, ours.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(tokens).logits[:, -1, :], atol=1e-4, rtol=0)


def test_plugin_loader_records(tmp_path):
    """The records the hook hands llmcore: matching, loading, tokenizer and metadata."""
    import llmcore_nanogpt

    (family,) = llmcore_nanogpt.llmcore_model_families()
    assert family.name == "nanogpt" and "tiny" in family.configs
    by_name = {l.name: l for l in family.loaders}
    original = _tiny(seed=9)
    ckpt = _save_nanogpt(original, tmp_path / "ckpt")
    hf = _save_hf(original, tmp_path / "hf")
    assert by_name["nanogpt-ckpt"].matches(ckpt) and not by_name["hf-gpt2"].matches(ckpt)
    assert by_name["hf-gpt2"].matches(hf)
    for loader, path in ((by_name["nanogpt-ckpt"], ckpt), (by_name["hf-gpt2"], hf)):
        loaded = loader.load(path, LoadOptions())
        _assert_same_logits(loaded.module, original)
        md = loaded.metadata
        assert (md.vocab_size, md.max_seq_len) == (257, 128)
        assert loaded.tokenizer is not None  # 257 tokens: the byte-level tokenizer


def test_load_hf_wrong_shapes_are_named(tmp_path):
    from llmcore.errors import LlmcoreError

    original = _tiny()
    folder = _save_hf(original, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_embd": 32}))
    with pytest.raises(LlmcoreError) as e:
        loaders.load_hf(folder, LoadOptions(), None)
    assert "wrong shape" in str(e.value) and e.value.stage == "load"


# ---- end to end -----------------------------------------------------------------------------


def test_cli_export_tiny_xnnpack(tmp_path):
    pytest.importorskip("llmcore_xnnpack")
    out = tmp_path / "m.pte"
    cmd = [sys.executable, "-m", "llmcore", "export", "--model", "nanogpt", "--config", "tiny",
           "--plugins", "xnnpack", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.is_file() and out.stat().st_size > 0
    report = json.loads((tmp_path / "m.report.json").read_text())

    n_layer = CONFIGS["tiny"].n_layer
    delegation = report["delegation"]
    assert 1 <= delegation["delegated_subgraphs"] <= n_layer + 2, delegation["delegated_subgraphs"]
    assert "XnnpackBackend" in delegation["by_backend"]
    assert "split-qkv" in report["transforms"]
    parity = report["parity"]
    assert "skipped" not in parity, parity
    assert parity["top1_agreement"] == 1.0, parity


# ---- nanoGPT's train.py checkpoints and their tokenizer ---------------------------------------

CHARS = "\n !',.?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # 59 characters


def _save_train_py(model: GPT, path: Path, dataset: str) -> Path:
    """A ckpt.pt as nanoGPT's train.py writes it: model, optimizer, model_args, iter_num,
    best_val_loss and the training config (which names the dataset)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    c = model.config
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    checkpoint = {
        "model": {"_orig_mod." + k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "model_args": dict(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, block_size=c.block_size,
                           bias=c.bias, vocab_size=c.vocab_size, dropout=0.0),
        "iter_num": 250,
        "best_val_loss": torch.tensor(1.4697),
        "config": {"out_dir": str(path.parent.name), "dataset": dataset, "batch_size": 64, "compile": True,
                   "learning_rate": 1e-3, "dtype": "bfloat16"},
    }
    torch.save(checkpoint, path)
    return path


def _save_meta(path: Path, chars: str = CHARS) -> Path:
    """meta.pkl as nanoGPT's data/shakespeare_char/prepare.py writes it."""
    import pickle

    path.parent.mkdir(parents=True, exist_ok=True)
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    with open(path, "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return path


def _char_model(vocab: int = len(CHARS), seed: int = 11) -> GPT:
    return _tiny(seed, dataclasses.replace(CONFIGS["tiny"], vocab_size=vocab, n_layer=1))


def _ckpt_loader():
    import llmcore_nanogpt

    (family,) = llmcore_nanogpt.llmcore_model_families()
    return next(l for l in family.loaders if l.name == "nanogpt-ckpt")


def _check_char_tokenizer(loaded, meta: Path):
    from tokenizers import Tokenizer

    assert loaded.tokenizer is not None and "char-level" in loaded.tokenizer.description
    assert str(meta) in loaded.tokenizer.description
    tok = Tokenizer.from_str(loaded.tokenizer.json_text)
    text = "Hello, World!\nIs it? O'er the sea."
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == [CHARS.index(ch) for ch in text]  # nanoGPT's encode: [stoi[c] for c in s]
    assert tok.decode(ids) == text  # and decode: "".join(itos[i] for i in l)


@pytest.mark.parametrize("where", ["nanogpt-layout", "beside", "cwd"])
def test_train_py_ckpt_uses_its_meta_pkl(tmp_path, monkeypatch, where):
    original = _char_model()
    repo = tmp_path / "nanoGPT"
    ckpt = _save_train_py(original, repo / "out-shakespeare-char" / "ckpt.pt", "shakespeare_char")
    if where == "nanogpt-layout":  # repo/data/<dataset>/meta.pkl, repo/out-*/ckpt.pt
        meta = _save_meta(repo / "data" / "shakespeare_char" / "meta.pkl")
    elif where == "beside":
        meta = _save_meta(ckpt.parent / "meta.pkl")
    else:
        meta = _save_meta(tmp_path / "elsewhere" / "data" / "shakespeare_char" / "meta.pkl")
        monkeypatch.chdir(tmp_path / "elsewhere")
        meta = Path.cwd() / "data" / "shakespeare_char" / "meta.pkl"
    loaded = _ckpt_loader().load(ckpt, LoadOptions())
    _assert_same_logits(loaded.module, original)
    _check_char_tokenizer(loaded, meta)
    assert loaded.metadata.vocab_size == len(CHARS) and loaded.metadata.eos_ids == ()
    assert loaded.source == str(ckpt)


def test_train_py_ckpt_without_meta_uses_gpt2_bpe(tmp_path, monkeypatch):
    """No meta.pkl: nanoGPT's sample.py falls back to GPT-2's BPE; train.py pads its vocabulary to 50304."""
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    from llmcore_nanogpt.tokenizer import EOT, bytes_to_unicode

    table = bytes_to_unicode()
    (gpt2 / "vocab.json").write_text(json.dumps({**{table[b]: b for b in range(256)}, EOT: 256}))
    (gpt2 / "merges.txt").write_text("#version: 0.2\n")
    monkeypatch.setenv("LLMCORE_GPT2_TOKENIZER", str(gpt2))
    original = GPT(dataclasses.replace(CONFIGS["tiny"], vocab_size=50304, n_layer=1, n_embd=16, n_head=2)).init_random(3)
    ckpt = _save_train_py(original, tmp_path / "run" / "out" / "ckpt.pt", "openwebtext")
    loaded = _ckpt_loader().load(ckpt, LoadOptions())
    assert loaded.tokenizer.description.startswith("GPT-2 BPE") and str(gpt2) in loaded.tokenizer.description
    assert loaded.metadata.vocab_size == 50304


def test_train_py_ckpt_without_any_tokenizer_says_where_it_looked(tmp_path, monkeypatch):
    from llmcore.errors import LlmcoreError

    monkeypatch.chdir(tmp_path)
    ckpt = _save_train_py(_char_model(), tmp_path / "out" / "ckpt.pt", "shakespeare_char")
    with pytest.raises(LlmcoreError) as e:
        _ckpt_loader().load(ckpt, LoadOptions())
    assert "meta.pkl" in str(e.value) and "data/shakespeare_char/meta.pkl" in str(e.value)
    assert e.value.plugin == "nanogpt" and "--tokenizer" in e.value.fix
    meta = _save_meta(tmp_path / "data" / "shakespeare_char" / "meta.pkl")  # now found through the CWD
    loaded = _ckpt_loader().load(ckpt, LoadOptions())
    assert "char-level" in loaded.tokenizer.description
    explicit = tmp_path / "mine.json"  # but --tokenizer wins over it
    explicit.write_text(loaded.tokenizer.json_text)
    assert _ckpt_loader().load(ckpt, LoadOptions(tokenizer_path=explicit)).tokenizer.description == str(explicit)


def test_meta_pkl_that_runs_code_is_refused(tmp_path):
    import pickle

    from llmcore.errors import LlmcoreError

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    ckpt = _save_train_py(_char_model(), tmp_path / "out" / "ckpt.pt", "shakespeare_char")
    with open(ckpt.parent / "meta.pkl", "wb") as f:
        pickle.dump({"stoi": {"a": 0}, "itos": {0: "a"}, "x": Payload()}, f)
    with pytest.raises(LlmcoreError) as e:
        _ckpt_loader().load(ckpt, LoadOptions())
    assert "refused" in str(e.value) and "pathlib" in str(e.value) and not marker.exists()


def test_meta_pkl_larger_than_the_model_vocabulary_is_refused(tmp_path):
    from llmcore.errors import LlmcoreError

    ckpt = _save_train_py(_char_model(vocab=20), tmp_path / "out" / "ckpt.pt", "shakespeare_char")
    _save_meta(ckpt.parent / "meta.pkl")
    with pytest.raises(LlmcoreError) as e:
        _ckpt_loader().load(ckpt, LoadOptions())
    assert f"{len(CHARS)} characters" in str(e.value)


def test_cli_export_train_py_ckpt_reports_its_tokenizer(tmp_path):
    """nanoGPT's ckpt.pt + data/<dataset>/meta.pkl export without --tokenizer; the report says which."""
    repo = tmp_path / "nanoGPT"
    ckpt = _save_train_py(_char_model(), repo / "out-shakespeare-char" / "ckpt.pt", "shakespeare_char")
    meta = _save_meta(repo / "data" / "shakespeare_char" / "meta.pkl")
    out = tmp_path / "m.pte"
    cmd = [sys.executable, "-m", "llmcore", "export", "--model", "nanogpt", "--checkpoint", str(ckpt),
           "--quiet", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "m.report.json").read_text())
    assert report["model"]["tokenizer"] == f"char-level ({len(CHARS)} characters) from nanoGPT's {meta}"
    assert report["parity"]["top1_agreement"] == 1.0
    written = json.loads((tmp_path / "tokenizer.json").read_text())
    assert written["model"]["vocab"] == {ch: i for i, ch in enumerate(CHARS)}
