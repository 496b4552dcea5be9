"""The nesting limit on JSON and YAML from users (llmcore/nesting.py), and each reader that
goes through it.

Authorities: a recursive count over ``json.loads``' own result for the pre-scan (on any
JSON hypothesis draws, strings full of brackets, quotes and backslashes included); for the
readers, a document 100,000 levels deep, which Python's parsers met with a RecursionError.
The CLI cases (export, run, chat, serve) are in the bad-input matrix (tests/test_bad_inputs.py),
the server's in tests/test_serve.py, the C++ reader's in tests/runtime/test_tokenizer_json_depth.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmcore import nesting
from llmcore.errors import LlmcoreError

DEEP = "[" * 100_000 + "]" * 100_000
TOKENIZER = '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}'


def true_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(true_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(true_depth, value.values()), default=0)
    return 0


tricky_text = st.text(alphabet='[]{}"\\ab\n\u00e9', max_size=6)
json_values = st.recursive(st.none() | st.integers() | tricky_text,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
                           max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(value=json_values, ascii_only=st.booleans(), limit=st.integers(0, 8))
def test_the_prescan_counts_what_the_parser_nests(value, ascii_only, limit):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert nesting.deeper_than(text, limit) == (true_depth(value) > limit)


def test_the_limit_is_512_levels_and_bytes_are_read_as_json_reads_them():
    assert nesting.loads("[" * 512 + "]" * 512, what="x") is not None
    with pytest.raises(LlmcoreError) as refused:
        nesting.loads("[" * 513 + "]" * 513, what="the thing", stage="serve")
    assert refused.value.one_line() == ("[serve] the thing nests arrays or objects more than 512 deep. Fix: "
                                        + nesting.too_deep("x", stage="x").fix)
    assert nesting.loads('{"a": ["[[[[", "\\\\", "\\""]}'.encode("utf-16"), what="x") == {"a": ["[[[[", "\\", '"']}
    with pytest.raises(json.JSONDecodeError):  # malformed JSON stays the caller's to describe
        nesting.loads("{not json", what="x")


def test_yaml_nested_past_the_parser_is_one_error():
    assert nesting.yaml_loads("a: [[1]]", what="x", stage="recipe") == {"a": [[1]]}
    with pytest.raises(LlmcoreError, match=r"^\[matrix\] m.yaml nests lists or mappings deeper"):
        nesting.yaml_loads("a: " + DEEP, what="m.yaml", stage="matrix")


def refused_naming(path: Path, read) -> str:
    """``read()`` raises one LlmcoreError, on one line, that names ``path``."""
    with pytest.raises(LlmcoreError) as refused:
        read()
    line = refused.value.one_line()
    assert "\n" not in line and str(path) in line and "more than 512 deep" in line
    return line


def test_the_llama_plugins_json_files(tmp_path):
    from llmcore.records import LoadOptions
    from llmcore_llama import formats, loaders, tokenization

    good = tmp_path / "tokenizer.json"
    good.write_text(TOKENIZER)
    config = tmp_path / "tokenizer_config.json"
    config.write_text('{"chat_template": ' + DEEP + "}")
    refused_naming(config, lambda: tokenization.tokenizer_json_info(good))  # a neighbour, not only the file

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model-00001-of-00001.safetensors").write_bytes(b"")
    (hf / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}")
    refused_naming(hf / "model.safetensors.index.json", lambda: formats.hf_files(hf))

    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "consolidated.00.pth").write_bytes(b"")
    (meta / "params.json").write_text('{"dim": ' + DEEP + "}")
    refused_naming(meta / "params.json", lambda: loaders.load_meta(meta, LoadOptions()))


def test_the_nanogpt_plugins_json_files(tmp_path):
    from llmcore_nanogpt import loaders, tokenizer

    (tmp_path / "vocab.json").write_text('{"a": ' + DEEP + "}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    refused_naming(tmp_path / "vocab.json", lambda: tokenizer.load_tokenizer(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": ' + DEEP + "}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    refused_naming(tmp_path / "config.json", lambda: loaders.claims_hf(tmp_path))


def test_the_cores_readers(tmp_path):
    from llmcore.apps.matrix import load_matrix
    from llmcore.builtins.commands import _key_values
    from llmcore.runtime.chat_template import load_template
    from llmcore.runtime.constrain import parse_tool_call

    matrix = tmp_path / "release.yaml"
    matrix.write_text("models: " + DEEP + "\n")
    with pytest.raises(LlmcoreError, match="release.yaml' nests lists or mappings deeper"):
        load_matrix(str(matrix))
    with pytest.raises(LlmcoreError, match="--quantize-option group_size nests lists or mappings deeper"):
        _key_values(["group_size=" + DEEP], "--quantize-option")
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "x", "bos_token": ' + DEEP + "}")
    refused_naming(tmp_path / "tokenizer_config.json", lambda: load_template(tmp_path / "tokenizer.json"))
    # a model's reply nested past the limit is a reply, not a tool call
    assert parse_tool_call('{"name": "f", "arguments": {"a": ' + DEEP + "}}", tagged=False) is None
