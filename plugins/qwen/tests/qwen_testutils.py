"""Tiny random Qwen2 / Qwen3 checkpoints written by transformers' own classes.

The reference for every test is transformers' model read back from the same folder, so a
layout, bias or norm that llmcore reads differently shows in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
MAX_POS = 64

# Each family with the switches that make it differ from Llama; ``tie_word_embeddings`` as
# the small published sizes ship (Qwen2.5-0.5B, Qwen3-0.6B).
FAMILIES = {
    "qwen2": dict(cls="Qwen2", config=dict(tie_word_embeddings=True)),
    "qwen3": dict(cls="Qwen3", config=dict(head_dim=32, tie_word_embeddings=True)),  # 4 heads x 32 != 64
    "qwen3-bias": dict(cls="Qwen3", config=dict(head_dim=24, attention_bias=True, tie_word_embeddings=False)),
}


def hf_checkpoint(folder: Path, family: str, *, seed: int = 0, tokenizer: bool = True, **config) -> Path:
    """Save a random ``family`` model (dim 64, 2 layers, 4/2 heads) with transformers."""
    import transformers

    spec = FAMILIES[family]
    cfg = getattr(transformers, spec["cls"] + "Config")(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
        vocab_size=VOCAB, max_position_embeddings=MAX_POS, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **{**spec["config"], **config},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, spec["cls"] + "ForCausalLM")(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that a misread bias, norm or layout moves the logits
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
    """The llama plugin's tiny byte-level BPE (320 ids) with a ChatML template, as Qwen ships."""
    from llmcore_llama.tokenization import tiny_tokenizer

    tok = tiny_tokenizer(VOCAB)
    (folder / "tokenizer.json").write_text(tok.json_text)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|eot_id|>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }))


def edit_config(folder: Path, change) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def reference(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def greedy(next_logits, prompt: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens, ``next_logits(all tokens so far) -> logits of the last``."""
    out = list(prompt)
    for _ in range(steps):
        out.append(int(torch.argmax(next_logits(out))))
    return out[len(prompt):]
