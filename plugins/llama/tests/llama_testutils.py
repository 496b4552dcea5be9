"""Helpers shared by the llama plugin tests: random models, a naive reference, file writers."""

from __future__ import annotations

import json
import math

from pathlib import Path
from typing import Optional

import torch

from llmcore_llama.config import LlamaConfig
from llmcore_llama.model import Transformer
from llmcore_llama.testing import HF_LAYER_NAMES, gguf_name, random_k_blocks  # noqa: F401  (re-exported)
from llmcore_llama.testing import write_llama_gguf as write_gguf  # these tests' name for it

TINY = LlamaConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=320,
    hidden_dim=160,
    norm_eps=1e-5,
    rope_theta=10000.0,
    max_seq_len=64,
    tie_embeddings=False,
)


def random_model(config: LlamaConfig = TINY, seed: int = 0, std: float = 0.2) -> Transformer:
    """A model with weights large enough that layout mistakes change the logits a lot."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def meta_state_dict(model: Transformer) -> dict:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        sd.pop("output.weight", None)
    return sd


def tokens(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------
# A deliberately naive reference forward (Meta layout, complex-number RoPE, explicit loops)
# --------------------------------------------------------------------------------------


def reference_forward(sd: dict, c: LlamaConfig, toks: torch.Tensor, positions: Optional[torch.Tensor] = None,
                      inv_freq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All-position logits ``[T, V]`` computed one head and one query at a time."""
    hd = c.resolved_head_dim
    T = toks.shape[1]
    if positions is None:
        positions = torch.arange(T)
    if inv_freq is None:
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    angles = positions.float()[:, None] * inv_freq[None, :]
    rot = torch.polar(torch.ones_like(angles), angles)  # [T, hd/2] complex

    def rope(x):  # [T, hd]
        xc = torch.view_as_complex(x.float().reshape(T, hd // 2, 2).contiguous())
        return torch.view_as_real(xc * rot).reshape(T, hd)

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.norm_eps) * w

    out_w = sd.get("output.weight", sd["tok_embeddings.weight"])
    h = sd["tok_embeddings.weight"][toks[0]]
    group = c.n_heads // c.n_kv_heads
    for i in range(c.n_layers):
        p = f"layers.{i}."
        x = rms(h, sd[p + "attention_norm.weight"])
        q = x @ sd[p + "attention.wq.weight"].T
        k = x @ sd[p + "attention.wk.weight"].T
        v = x @ sd[p + "attention.wv.weight"].T
        heads = []
        for hq in range(c.n_heads):
            hk = hq // group
            qh = rope(q[:, hq * hd:(hq + 1) * hd])
            kh = rope(k[:, hk * hd:(hk + 1) * hd])
            vh = v[:, hk * hd:(hk + 1) * hd]
            rows = []
            for t in range(T):
                scores = (kh[: t + 1] @ qh[t]) / math.sqrt(hd)
                rows.append(torch.softmax(scores, dim=0) @ vh[: t + 1])
            heads.append(torch.stack(rows))
        h = h + torch.cat(heads, dim=1) @ sd[p + "attention.wo.weight"].T
        x = rms(h, sd[p + "ffn_norm.weight"])
        a = x @ sd[p + "feed_forward.w1.weight"].T
        b = x @ sd[p + "feed_forward.w3.weight"].T
        h = h + (a * torch.sigmoid(a) * b) @ sd[p + "feed_forward.w2.weight"].T
    return rms(h, sd["norm.weight"]) @ out_w.T


def hf_reference_forward(hf: dict, cfg: dict, toks: torch.Tensor) -> torch.Tensor:
    """Hugging Face's LlamaForCausalLM math on HF-layout weights (rotate_half RoPE)."""
    D, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = D // H
    T = toks.shape[1]
    eps = cfg["rms_norm_eps"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.arange(T).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rotate_half(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    h = hf["model.embed_tokens.weight"][toks[0]]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, hf[p + "input_layernorm.weight"])
        q = (x @ hf[p + "self_attn.q_proj.weight"].T).view(T, H, hd).transpose(0, 1)
        k = (x @ hf[p + "self_attn.k_proj.weight"].T).view(T, KV, hd).transpose(0, 1)
        v = (x @ hf[p + "self_attn.v_proj.weight"].T).view(T, KV, hd).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=0)
        v = v.repeat_interleave(H // KV, dim=0)
        att = (q @ k.transpose(1, 2)) / math.sqrt(hd)
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        y = (torch.softmax(att, -1) @ v).transpose(0, 1).reshape(T, D)
        h = h + y @ hf[p + "self_attn.o_proj.weight"].T
        x = rms(h, hf[p + "post_attention_layernorm.weight"])
        g = x @ hf[p + "mlp.gate_proj.weight"].T
        u = x @ hf[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(g) * u) @ hf[p + "mlp.down_proj.weight"].T
    x = rms(h, hf["model.norm.weight"])
    out = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    return x @ out.T


# --------------------------------------------------------------------------------------
# Writers for checkpoint formats
# --------------------------------------------------------------------------------------


def hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What HF's Llama conversion script does to Meta's wq/wk (written independently of
    the plugin's inverse)."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def hf_config_dict(c: LlamaConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "intermediate_size": c.hidden_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_seq_len,
        "tie_word_embeddings": c.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    }


def meta_to_hf(sd: dict, c: LlamaConfig) -> dict:
    hf = {
        "model.embed_tokens.weight": sd["tok_embeddings.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    if not c.tie_embeddings:
        hf["lm_head.weight"] = sd["output.weight"]
    for i in range(c.n_layers):
        for meta, hfn in HF_LAYER_NAMES.items():
            t = sd[f"layers.{i}.{meta}"]
            if meta == "attention.wq.weight":
                t = hf_permute(t, c.n_heads)
            elif meta == "attention.wk.weight":
                t = hf_permute(t, c.n_kv_heads)
            hf[f"model.layers.{i}.{hfn}"] = t.contiguous()
    return hf


def write_hf(folder: Path, sd: dict, c: LlamaConfig, *, shards: int = 1, extra_config: Optional[dict] = None) -> dict:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hf = meta_to_hf(sd, c)
    cfg = hf_config_dict(c)
    cfg.update(extra_config or {})
    (folder / "config.json").write_text(json.dumps(cfg))
    names = sorted(hf)
    if shards == 1:
        save_file({k: hf[k].contiguous() for k in names}, str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: hf[k].contiguous() for k in part}, str(folder / fname))
            weight_map.update({k: fname for k in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return hf


def meta_params(c: LlamaConfig) -> dict:
    return {
        "dim": c.dim,
        "n_layers": c.n_layers,
        "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads,
        "vocab_size": c.vocab_size,
        "multiple_of": 32,
        "norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "max_seq_len": c.max_seq_len,
    }


def write_meta(folder: Path, sd: dict, c: LlamaConfig) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.json").write_text(json.dumps(meta_params(c)))
    torch.save(sd, folder / "consolidated.00.pth")


# --------------------------------------------------------------------------------------
# Small tokenizers trained by the tests themselves
# --------------------------------------------------------------------------------------

_WORDS = (
    "the quick brown fox jumps over lazy dog a small model reads short story about sea sun rain "
    "once upon time there was little cat that liked to play in garden with her friends café naïve "
    "über 東京 données 1234 42 hello world: (x+y)*2; don't can't I'M"
).split()


def corpus_lines(n: int = 2000, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 15))) for _ in range(n)]


SAMPLE_TEXTS = [
    "the quick brown fox",
    "  leading spaces and  double   spaces ",
    "café 東京 ñandú 😀 zebra",
    "line1\nline2\ttab\n\n\n x",
    "12345 + 678",
    "DON'T stop I'M here",
    "",
    " ",
]


def train_sentencepiece(path: Path, **kwargs) -> Path:
    """Train a small SentencePiece model (Llama-2 style by default) into `path`."""
    import io

    import sentencepiece as spm

    opts = dict(
        vocab_size=500,
        hard_vocab_limit=False,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=0.9995,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        minloglevel=2,
    )
    opts.update(kwargs)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus_lines()), model_writer=buf, **opts)
    path.write_bytes(buf.getvalue())
    return path


def write_tiktoken(path: Path, n_merges: int = 300) -> Path:
    """A small tiktoken ranks file: 256 bytes then merges learned from the test corpus."""
    import base64

    from llmcore_llama.tokenization import _train_byte_bpe

    ranks = {bytes([b]): b for b in range(256)}
    for a, b in _train_byte_bpe("\n".join(corpus_lines(1000)), n_merges):
        ranks.setdefault(a + b, len(ranks))
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path
