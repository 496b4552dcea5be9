"""Build tiny test `.pte` programs (and a tiny tokenizer.json) for the C++ runner tests.

Throwaway test-fixture generator: a small GPT-like model with random weights, exported
with torch.export + ExecuTorch (XNNPACK partitioner), following docs/pte-contract.md.

    python tests/runtime/make_test_pte.py OUT_DIR [--variant nocache|kv|all]

Writes into OUT_DIR:
    tokenizer.json     byte-level BPE: 256 byte tokens, <|endoftext|> (id 256), a few merges,
                       two more special tokens
    nocache.pte        forward(tokens[1,T]) -> logits[1,V]
    kv.pte             forward(tokens[1,T], input_pos[1]) -> logits[1,V], custom KV-cache ops
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

# Byte tokens + eos + merges + extra specials.
MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("e", "r"),
    ("Ġ", "a"),
    ("o", "n"),
    ("r", "e"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
]
EOS = "<|endoftext|>"
EXTRA_SPECIALS = ["<|im_start|>", "<|im_end|>"]


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable unicode char mapping."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping = {}
    n = 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def make_tokenizer_json(merges_as_pairs=False):
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    vocab[EOS] = 256
    merges = []
    for a, b in MERGES:
        assert a in vocab and b in vocab, (a, b)
        vocab[a + b] = len(vocab)
        merges.append([a, b] if merges_as_pairs else f"{a} {b}")
    added = [{"id": 256, "content": EOS}]
    for s in EXTRA_SPECIALS:
        vocab[s] = len(vocab)
        added.append({"id": vocab[s], "content": s})
    added_tokens = [
        {
            "id": t["id"],
            "content": t["content"],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for t in added
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


class Block(nn.Module):
    def __init__(self, dim, n_heads, max_ctx, kv):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.kv = kv
        if kv:
            shape = (1, max_ctx, n_heads, self.head_dim)
            self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
            self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def attn(self, x, start_pos):
        b, t, d = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_heads, self.head_dim)
        if self.kv:
            torch.ops.llama.update_cache(k, self.k_cache, start_pos)
            torch.ops.llama.update_cache(v, self.v_cache, start_pos)
            y = torch.ops.llama.custom_sdpa(q, self.k_cache, self.v_cache, start_pos, None, 0.0, True)
        else:
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            ).transpose(1, 2)
        return self.wo(y.reshape(b, t, d))

    def forward(self, x, start_pos):
        x = x + self.attn(self.ln1(x), start_pos)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab, dim=64, n_layers=2, n_heads=4, max_ctx=64, kv=False):
        super().__init__()
        self.kv = kv
        self.max_ctx = max_ctx
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_ctx, dim) * 0.5)
        self.blocks = nn.ModuleList([Block(dim, n_heads, max_ctx, kv) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            self.tok.weight.normal_(0.0, 1.0)
            self.head.weight.normal_(0.0, 1.0 / math.sqrt(dim) * 3.0)

    def forward(self, tokens, input_pos=None):
        t = tokens.shape[1]
        if self.kv:
            start = input_pos[0].item()
            torch._check_is_size(start)
            torch._check(start < self.max_ctx)
            torch._check(start + t <= self.max_ctx)
            pos = self.pos.narrow(0, start, t)
        else:
            start = 0
            pos = self.pos[:t]
        x = self.tok(tokens) + pos.unsqueeze(0)
        for blk in self.blocks:
            x = blk(x, start)
        x = self.ln_f(x[:, -1, :])
        return self.head(x)


def export_pte(model, example, dynamic_shapes, constant_methods, path):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    ep = torch.export.export(model, example, dynamic_shapes=dynamic_shapes, strict=False)
    prog = to_edge_transform_and_lower(
        ep,
        partitioner=[XnnpackPartitioner()],
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
        constant_methods=constant_methods,
    ).to_executorch()
    with open(path, "wb") as f:
        f.write(prog.buffer)


def build_variant(name, out_dir, tok, seed, dim=64, layers=2, heads=4, pad_vocab=0):
    """Exports one test program; returns its path."""
    vocab = len(tok["model"]["vocab"]) + pad_vocab
    eos_id = tok["model"]["vocab"][EOS]
    common = {
        "get_vocab_size": vocab,
        "get_bos_id": eos_id,
        "get_eos_ids": [eos_id, tok["model"]["vocab"]["<|im_end|>"]],
    }
    kv = name in ("kv", "bench-kv")
    if kv:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers llama:: ops)
    if name == "nocache":
        max_seq, max_ctx, n_bos = 32, 96, 1
    elif name == "bare":
        max_seq, max_ctx, n_bos = 24, 0, 0
    elif name == "kv":
        max_seq, max_ctx, n_bos = 16, 64, 0
    elif name == "bench-kv":
        max_seq, max_ctx, n_bos = 128, 512, 0
    else:
        raise ValueError(name)
    torch.manual_seed(seed)
    m = TinyGPT(vocab, dim=dim, n_layers=layers, n_heads=heads, max_ctx=max_ctx if kv else max_seq, kv=kv).eval()
    t = torch.export.Dim("t", min=1, max=max_seq)
    if name == "bare":
        cm = {}  # no constant methods at all: the runner must fall back to defaults
    else:
        cm = dict(common)
        cm.update(
            get_max_seq_len=max_seq,
            get_max_context_len=max_ctx,
            get_n_bos=n_bos,
            use_kv_cache=kv,
            use_sdpa_with_kv_cache=kv,
            enable_dynamic_shape=True,
        )
    if kv:
        example = (torch.zeros(1, 4, dtype=torch.long), torch.tensor([0], dtype=torch.long))
        dyn = ({1: t}, None)
    else:
        example = (torch.zeros(1, 4, dtype=torch.long),)
        dyn = ({1: t},)
    path = os.path.join(out_dir, f"{name}.pte")
    with torch.no_grad():
        export_pte(m, example, dyn, cm or None, path)
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument(
        "--variant",
        action="append",
        choices=["nocache", "kv", "bare", "bench-kv"],
        help="program(s) to build (default: nocache, kv, bare)",
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--pad-vocab", type=int, default=0, help="extra logits beyond the tokenizer's vocab")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    tok = make_tokenizer_json()
    with open(os.path.join(args.out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, indent=1)
    for i, name in enumerate(args.variant or ["nocache", "kv", "bare"]):
        path = build_variant(name, args.out_dir, tok, args.seed + i, args.dim, args.layers, args.heads, args.pad_vocab)
        print("wrote", path, file=sys.stderr)


if __name__ == "__main__":
    main()
