"""Fuzzing what users hand llmcore: recipes, GGUF files and tokenizer files.

Every parser gets arbitrary input and structured mutations of a valid input, and must give
either a valid result or an :class:`~llmcore.errors.LlmcoreError`: never another exception,
never a hang (each example runs under an alarm as well as hypothesis' deadline), never a
crash of the interpreter. Tests that drive native parsers (the Rust `tokenizers`, the C++
protobuf parser of SentencePiece models) run their examples in a child process, so that a
segfault shows up as a failed test instead of taking pytest down.

Example counts are small so the file runs in well under a minute; raise them with
``LLMCORE_FUZZ_EXAMPLES=500`` for a longer run.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmcore.errors import LlmcoreError

SCALE = float(os.environ.get("LLMCORE_FUZZ_EXAMPLES", "0")) or None
HANG_S = 30


def fuzz(examples: int, deadline_s: float = 10.0):
    """Settings for one fuzzer: few examples by default, no example database on disk."""
    return settings(
        max_examples=int(SCALE) if SCALE else examples,
        deadline=timedelta(seconds=deadline_s),
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


class Hang(Exception):
    """An example ran past the alarm: the parser loops or allocates without end."""


@contextmanager
def no_hang(seconds: float = HANG_S):
    def expire(signum, frame):
        raise Hang(f"still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def outcome(fn):
    """Run ``fn`` under the alarm: its result, or the LlmcoreError it raised. Any other
    exception propagates and fails the example."""
    with no_hang():
        try:
            return fn()
        except LlmcoreError as exc:
            assert exc.one_line().strip(), "an LlmcoreError with an empty message"
            return exc


def in_child(test_name: str) -> None:
    """Run one of this module's fuzzers in a fresh interpreter: a segfault or abort in a
    native library fails the test instead of killing pytest."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_fuzz
        test_fuzz.{test_name}()
        """
    )
    env = {**os.environ, "RUST_BACKTRACE": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    if done.returncode < 0:
        pytest.fail(f"{test_name} crashed the interpreter with signal {-done.returncode}:\n{done.stderr[-3000:]}")
    assert done.returncode == 0, done.stderr[-5000:]


# ---- mutations ---------------------------------------------------------------------------------


@st.composite
def mutated_bytes(draw, original: bytes, *, protect: int = 0) -> bytes:
    """``original`` truncated, with bytes flipped, spliced or duplicated (never the first
    ``protect`` bytes, so that a magic number survives and the parser is reached)."""
    data = bytearray(original)
    kind = draw(st.sampled_from(["truncate", "flip", "splice", "duplicate", "mixed"]))
    if kind in ("truncate", "mixed"):
        data = data[: draw(st.integers(protect, max(protect, len(data) - 1)))]
    if kind in ("flip", "mixed") and len(data) > protect:
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(protect, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
    if kind == "splice" and len(data) > protect:
        i = draw(st.integers(protect, len(data)))
        data[i:i] = draw(st.binary(max_size=64))
    if kind == "duplicate" and len(data) > protect:
        i = draw(st.integers(protect, len(data) - 1))
        j = draw(st.integers(i, min(len(data), i + 256)))
        data[j:j] = data[i:j]
    return bytes(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_json(draw, document):
    """``document`` with one subtree replaced, removed, or given another type."""
    doc = json.loads(json.dumps(document))
    paths = []

    def walk(node, path):
        paths.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + (k,))
        elif isinstance(node, list):
            for i, v in enumerate(node[:6]):
                walk(v, path + (i,))

    walk(doc, ())
    path = draw(st.sampled_from(paths))
    replacement = draw(json_values)
    if not path:
        return replacement
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return doc


# ---- recipes -----------------------------------------------------------------------------------

yaml_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**80), 2**80)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["xnnpack", "int8-dynamic", "nanogpt", "tiny", "kv-cache", "a,b", ""])
)
yaml_data = st.recursive(
    yaml_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(yaml_scalars.filter(lambda k: k == k), inner, max_size=4),
    max_leaves=16,
)


def _field_names():
    from llmcore.recipe import FIELDS

    names = list(FIELDS)
    return names + [n.replace("_", "-") for n in names]


recipes = st.dictionaries(st.sampled_from(_field_names()) | st.text(max_size=12), yaml_data, max_size=6)


def _check_recipe(result):
    from llmcore.recipe import FIELDS, build_options

    if isinstance(result, LlmcoreError):
        return
    assert isinstance(result, dict) and set(result) <= set(FIELDS)
    merged = outcome(lambda: build_options(result, {"model": "m", "output": "o.pte"}))
    if not isinstance(merged, LlmcoreError):
        assert merged.model == "m" and merged.output == "o.pte"


@fuzz(100, deadline_s=2)
@given(data=yaml_data | recipes)
def test_parse_recipe_on_arbitrary_data(data):
    from llmcore.recipe import parse_recipe

    _check_recipe(outcome(lambda: parse_recipe(data)))


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + f"\nmax_seq_len: *a{levels - 1}\nquantize_options: {{x: *a{levels - 1}}}\n"


VALID_RECIPE = "model: nanogpt\nconfig: tiny\nplugins: [xnnpack]\nquantize: int8-dynamic\nquantize-options:\n  per_channel: true\nmax-seq-len: 64\nbackend_options: {xnnpack: {per_op_mode: false}}\n"


@fuzz(60, deadline_s=15)
@given(
    text=st.text(max_size=300)
    | st.binary(max_size=300)
    | mutated_bytes(VALID_RECIPE.encode())
    | st.builds(lambda n: "[" * n + "]" * n, st.integers(10, 1200))
    | st.builds(lambda n: "a:\n" + "".join(" " * i + "- b:\n" for i in range(n)), st.integers(50, 400))
)
@example(text=_alias_bomb())
@example(text="[" * 20_000)
@example(text=b"\xff\xfe\x00m\x00o\x00d\x00e\x00l")
@example(text="model: !!python/object/apply:os.system [echo pwned]\n")
@example(text="? [a, b]\n: 1\n")
@example(text="seed: 1" + "0" * 40 + "\n")
@example(text="backend_options: {xnnpack: 5}\n")
def test_load_recipe_on_arbitrary_text(text):
    from llmcore.recipe import load_recipe

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "recipe.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
        _check_recipe(outcome(lambda: load_recipe(path)))


# ---- GGUF ----------------------------------------------------------------------------------------

GGUF_TOKENS = ["<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "ab", "cd", "abcd"]
GGUF_MERGES = ["a b", "c d", "ab cd"]


def _small_gguf(path: Path) -> None:
    """A complete little llama GGUF (dim 32, one layer, a gpt2 tokenizer), some tensors
    quantized, written with gguf.GGUFWriter."""
    import gguf
    import numpy as np
    from gguf import quants as gq

    vocab, dim, hidden, heads, kv_heads = len(GGUF_TOKENS), 32, 64, 2, 1
    head_dim = dim // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(GGUF_TOKENS)
    w.add_token_types([3, 3] + [1] * (vocab - 2))
    w.add_token_merges(GGUF_MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template("{{ messages[0]['content'] }}")
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (vocab, dim),
        "output_norm.weight": (dim,),
        "blk.0.attn_norm.weight": (dim,),
        "blk.0.ffn_norm.weight": (dim,),
        "blk.0.attn_q.weight": (dim, dim),
        "blk.0.attn_k.weight": (kv_heads * head_dim, dim),
        "blk.0.attn_v.weight": (kv_heads * head_dim, dim),
        "blk.0.attn_output.weight": (dim, dim),
        "blk.0.ffn_gate.weight": (hidden, dim),
        "blk.0.ffn_up.weight": (hidden, dim),
        "blk.0.ffn_down.weight": (dim, hidden),
    }
    quantized = {"blk.0.ffn_gate.weight": gguf.GGMLQuantizationType.Q8_0,
                 "blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q4_0,
                 "blk.0.attn_q.weight": gguf.GGMLQuantizationType.F16}
    for name, shape in shapes.items():
        value = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        qtype = quantized.get(name)
        if qtype is None:
            w.add_tensor(name, value)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, value.astype(np.float16))
        else:
            data = gq.quantize(value, qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_length_fields(data: bytes) -> list[tuple[int, str]]:
    """Offsets of every count, length, rank, dimension and tensor offset in a GGUF
    header, with their struct format: where a huge number does the most damage."""
    scalars = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    fields = [(8, "<Q"), (16, "<Q")]
    tensor_count, kv_count = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string():
        nonlocal pos
        fields.append((pos, "<Q"))
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n

    def value(vtype):
        nonlocal pos
        if vtype in scalars:
            pos += scalars[vtype]
        elif vtype == 8:
            string()
        else:
            itype, n = struct.unpack_from("<IQ", data, pos)
            fields.append((pos, "<I"))
            fields.append((pos + 4, "<Q"))
            pos += 12
            if itype in scalars:
                pos += n * scalars[itype]
            else:
                for _ in range(n):
                    value(itype)

    for _ in range(kv_count):
        string()
        (vtype,) = struct.unpack_from("<I", data, pos)
        fields.append((pos, "<I"))
        pos += 4
        value(vtype)
    for _ in range(tensor_count):
        string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        fields.append((pos, "<I"))
        pos += 4
        fields.extend((pos + 8 * i, "<Q") for i in range(n_dims))
        pos += 8 * n_dims
        fields.append((pos, "<I"))
        fields.append((pos + 4, "<Q"))
        pos += 12
    return fields


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    _small_gguf(path)
    return path.read_bytes()


def _load_gguf_bytes(data: bytes):
    from llmcore.records import LoadOptions
    from llmcore_llama import loaders

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.gguf"
        path.write_bytes(data)
        result = outcome(lambda: loaders.load_gguf(path, LoadOptions()))
    if not isinstance(result, LlmcoreError):
        assert result.metadata.vocab_size > 0 and result.module is not None
        if result.tokenizer is not None:
            from llmcore.runtime.generate import TextTokenizer

            outcome(lambda: TextTokenizer(result.tokenizer.json_text).encode("abcd"))
    return result


def test_the_small_gguf_loads(small_gguf):
    result = _load_gguf_bytes(small_gguf)
    assert not isinstance(result, LlmcoreError), result
    assert result.tokenizer is not None and result.metadata.bos_id == 0


@fuzz(60)
@given(data=st.binary(max_size=512).map(lambda b: b"GGUF" + b) | st.binary(max_size=64))
@example(data=b"GGUF\x03\x00\x00\x00" + b"\xff" * 16)
@example(data=b"GGUF")
def test_gguf_reader_on_arbitrary_bytes(data):
    _load_gguf_bytes(data)


@fuzz(60)
@given(data=st.data())
def test_gguf_reader_on_mutated_files(small_gguf, data):
    _load_gguf_bytes(data.draw(mutated_bytes(small_gguf, protect=4)))


HUGE = [2**64 - 1, 2**63, 2**32 - 1, 2**31, 2**20, 10**9, 0]


@fuzz(80)
@given(data=st.data())
def test_gguf_reader_with_huge_counts_and_lengths(small_gguf, data):
    fields = _gguf_length_fields(small_gguf)
    mutated = bytearray(small_gguf)
    for _ in range(data.draw(st.integers(1, 3))):
        offset, fmt = data.draw(st.sampled_from(fields))
        limit = 2 ** (8 * struct.calcsize(fmt)) - 1
        value = data.draw(st.sampled_from(HUGE) | st.integers(0, limit)) & limit
        struct.pack_into(fmt, mutated, offset, value)
    _load_gguf_bytes(bytes(mutated))


# ---- tokenizers ------------------------------------------------------------------------------------


def _nanogpt_tokenizer(folder: Path, names: tuple[str, str], vocab: bytes, merges: bytes):
    from llmcore_nanogpt.tokenizer import load_tokenizer

    (folder / names[0]).write_bytes(vocab)
    (folder / names[1]).write_bytes(merges)
    result = outcome(lambda: load_tokenizer(folder))
    if not isinstance(result, LlmcoreError):
        from llmcore.runtime.generate import TextTokenizer

        doc = json.loads(result.json_text)
        assert isinstance(doc["model"]["vocab"], dict)
        tok = outcome(lambda: TextTokenizer(result.json_text))
        if not isinstance(tok, LlmcoreError):
            ids = outcome(lambda: tok.encode("hello world"))
            if not isinstance(ids, LlmcoreError):
                outcome(lambda: tok.decode(ids))
    return result


SMALL_VOCAB = {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "<|endoftext|>": 5}
SMALL_MERGES = "#version: 0.2\na b\nab c\n"


@fuzz(60)
@given(
    names=st.sampled_from([("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")]),
    vocab=st.binary(max_size=200)
    | st.builds(lambda d: json.dumps(d).encode(), mutated_json(SMALL_VOCAB))
    | mutated_bytes(json.dumps(SMALL_VOCAB).encode()),
    merges=st.binary(max_size=200) | st.text(max_size=100).map(str.encode) | mutated_bytes(SMALL_MERGES.encode()),
)
@example(names=("vocab.json", "merges.txt"), vocab=b"[" * 100_000, merges=b"")
@example(names=("vocab.json", "merges.txt"), vocab=b'{"a": true}', merges=b"")
def _fuzz_nanogpt_tokenizer_files(names, vocab, merges):
    with tempfile.TemporaryDirectory() as folder:
        _nanogpt_tokenizer(Path(folder), names, vocab, merges)


def test_nanogpt_tokenizer_files():
    in_child("_fuzz_nanogpt_tokenizer_files")


def _tokenizer_json_seed() -> dict:
    from llmcore_llama.tokenization import tiny_tokenizer

    return json.loads(tiny_tokenizer(280).json_text)


def _text_tokenizer(text: str):
    from llmcore.runtime.generate import TextTokenizer

    tok = outcome(lambda: TextTokenizer(text))
    if not isinstance(tok, LlmcoreError):
        ids = outcome(lambda: tok.encode("Hello wörld 123 <|eot_id|>"))
        if not isinstance(ids, LlmcoreError):
            outcome(lambda: tok.decode(ids + [0, 10**6]))
            outcome(lambda: tok.vocab_size)
    return tok


@fuzz(80)
@given(
    text=st.text(max_size=200)
    | st.builds(json.dumps, json_values)
    | st.builds(json.dumps, mutated_json(_tokenizer_json_seed()))
)
@example(text='{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}, '
              '"normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAA"}}')
@example(text="[" * 5000)
def _fuzz_text_tokenizer(text):
    _text_tokenizer(text)


def test_text_tokenizer_on_arbitrary_json():
    in_child("_fuzz_text_tokenizer")


def _llama_tokenizer_file(name: str, data: bytes):
    """The llama plugin's --tokenizer path: a file, recognised by its content."""
    from llmcore.records import LoadOptions
    from llmcore_llama.loaders import resolve_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_bytes(data)
        info = outcome(lambda: resolve_tokenizer(LoadOptions(tokenizer_path=path)))
        if not isinstance(info, LlmcoreError):
            assert info.json_text and info.size >= 0
            _text_tokenizer(info.json_text)
        return info


def _sentencepiece_seed() -> bytes:
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    for piece, kind in [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<0x41>", 6), ("\u2581", 1), ("a", 1), ("b", 1),
                        ("ab", 1), ("\u2581ab", 1)]:
        p = proto.pieces.add()
        p.piece, p.type, p.score = piece, kind, -float(len(proto.pieces))
    proto.trainer_spec.model_type = 2  # BPE
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 0, 1, 2
    proto.trainer_spec.byte_fallback = True
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = True
    return proto.SerializeToString()


def _tiktoken_seed() -> bytes:
    import base64

    tokens = [bytes([b]) for b in range(256)] + [b"ab", b"abc", b" the"]
    return b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens))


@fuzz(80)
@given(
    case=st.tuples(st.just("tokenizer.json"), st.binary(max_size=200) | mutated_bytes(b'{"model": {"vocab": {"a": 0}}}'))
    | st.tuples(
        st.just("tokenizer.json"),
        st.builds(lambda d: json.dumps(d).encode(), mutated_json(_tokenizer_json_seed())),
    )
    | st.tuples(st.just("tokenizer.model"), st.binary(max_size=300))
    | st.tuples(st.just("tokenizer.model"), mutated_bytes(_sentencepiece_seed()))
    | st.tuples(st.just("tiktoken.model"), mutated_bytes(_tiktoken_seed()))
)
@example(case=("tokenizer.model", _sentencepiece_seed()))
@example(case=("tiktoken.model", _tiktoken_seed()))
@example(case=("tokenizer.json", b'{"model": {"vocab": {"a": "x"}}}'))
@example(case=("tokenizer.json", b'{"model": {"vocab": [[1, 2]]}, "added_tokens": [{"id": "x"}]}'))
def _fuzz_llama_tokenizer_files(case):
    _llama_tokenizer_file(*case)


def test_llama_tokenizer_files():
    in_child("_fuzz_llama_tokenizer_files")


GGUF_TOKENIZER_FIELDS = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "smollm",
    "tokenizer.ggml.tokens": GGUF_TOKENS,
    "tokenizer.ggml.token_type": [3, 3] + [1] * (len(GGUF_TOKENS) - 2),
    "tokenizer.ggml.merges": GGUF_MERGES,
    "tokenizer.ggml.bos_token_id": 0,
    "tokenizer.ggml.eos_token_id": 1,
    "tokenizer.ggml.add_bos_token": True,
    "tokenizer.chat_template": "{{ messages[0]['content'] }}",
}
SPM_FIELDS = {
    **GGUF_TOKENIZER_FIELDS,
    "tokenizer.ggml.model": "llama",
    "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "<0x41>", "\u2581", "a", "b", "ab"],
    "tokenizer.ggml.token_type": [2, 3, 3, 6, 1, 1, 1, 1],
    "tokenizer.ggml.scores": [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -1.5],
}


@fuzz(100)
@given(fields=mutated_json(GGUF_TOKENIZER_FIELDS) | mutated_json(SPM_FIELDS))
@example(fields={**GGUF_TOKENIZER_FIELDS, "tokenizer.ggml.bos_token_id": "zero"})
@example(fields={**GGUF_TOKENIZER_FIELDS, "tokenizer.ggml.token_type": 5})
@example(fields={**SPM_FIELDS, "tokenizer.ggml.scores": ["x"] * 8})
@example(fields={**SPM_FIELDS, "tokenizer.ggml.unknown_token_id": 10**9})
def _fuzz_tokenizer_from_gguf_fields(fields):
    """What load_gguf does with the tokenizer metadata it read."""
    from llmcore.records import LoadOptions
    from llmcore_llama.loaders import resolve_tokenizer
    from llmcore_llama.tokenization import tokenizer_from_gguf_fields

    if not isinstance(fields, dict):
        fields = {"tokenizer.ggml.model": fields}
    info = outcome(lambda: resolve_tokenizer(LoadOptions(), lambda: tokenizer_from_gguf_fields(fields.get)))
    if not isinstance(info, LlmcoreError):
        _text_tokenizer(info.json_text)


def test_tokenizer_from_gguf_fields():
    in_child("_fuzz_tokenizer_from_gguf_fields")
