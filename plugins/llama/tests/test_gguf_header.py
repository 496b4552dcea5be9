"""GGUFFile reads a GGUF's header itself (formats.read_gguf_header); gguf.GGUFReader, on
files written with gguf.GGUFWriter, is the authority for what it must give."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from llmcore.errors import LlmcoreError
from llmcore_llama import loaders


def _write_every_kind(path, endianess=gguf.GGUFEndian.LITTLE):
    """A GGUF with a key of every value type and tensors of plain and block types."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1 / 3)  # not exact in float32: the value read is float32's
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.text", "héllo ✓")
    w.add_string("t.empty_text", "")
    w.add_array("t.strings", ["a", "ß", "", "Ġthe"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1 / 3])
    w.add_array("t.bools", [True, False, True])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 32)).astype(np.float16))
    w.add_tensor("i32", np.arange(5, dtype=np.int32))
    for qt in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        values = rng.standard_normal((2, 64)).astype(np.float32)
        w.add_tensor(qt.name.lower(), gq.quantize(values, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_reads_as_gguf_does(path):
    ours, theirs = loaders.GGUFFile(path), gguf.GGUFReader(str(path))
    # the reader adds GGUF.version, GGUF.tensor_count and GGUF.kv_count, which are not keys of the file
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        expected, got = theirs.fields[key].contents(), ours.get(key)
        assert got == expected and type(got) is type(expected), key
        if isinstance(expected, list):
            assert [type(v) for v in got] == [type(v) for v in expected], key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == ref.tensor_type and tuple(mine.shape) == tuple(int(d) for d in ref.shape)
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (ref.n_elements, ref.n_bytes, ref.data_offset)
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
        assert np.array_equal(mine.data, ref.data), mine.name
    return ours


def test_every_value_type_and_tensor_reads_as_gguf_reads_it(tmp_path):
    g = _assert_reads_as_gguf_does(_write_every_kind(tmp_path / "every.gguf"))
    assert g.get("t.text") == "héllo ✓" and g.get("t.strings") == ["a", "ß", "", "Ġthe"]
    assert g.get("t.u64") == 2**63 + 5 and g.get("missing", 7) == 7


def test_a_big_endian_file_reads_as_gguf_reads_it(tmp_path):
    g = _assert_reads_as_gguf_does(_write_every_kind(tmp_path / "big.gguf", gguf.GGUFEndian.BIG))
    assert g.tensors[0].data.dtype.byteorder == ">"  # the data are viewed, not copied


def test_a_model_file_reads_as_gguf_reads_it(tmp_path):
    """A llama GGUF with a tokenizer (vocabulary, merges, token types) and quantized weights."""
    from llama_testutils import meta_state_dict, random_model, write_gguf
    from test_llama_gguf import _gpt2_tokenizer_fields

    _, fields = _gpt2_tokenizer_fields()
    model = random_model()
    types = {n: Q.Q8_0 for n, t in meta_state_dict(model).items() if t.dim() == 2}
    write_gguf(tmp_path / "m.gguf", meta_state_dict(model), model.config, tokenizer=fields, types=types)
    _assert_reads_as_gguf_does(tmp_path / "m.gguf")


def test_a_string_that_is_not_utf8_fails_the_key_that_is_read(tmp_path):
    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("t.good", "fine")
    w.add_string("t.bad", "xyzzy")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    path.write_bytes(path.read_bytes().replace(b"xyzzy", b"xy\xffzy"))
    g = loaders.GGUFFile(path)
    assert g.get("t.good") == "fine"
    with pytest.raises(LlmcoreError) as e:
        g.get("t.bad")
    assert "'t.bad' is malformed" in e.value.message


def test_a_key_listed_twice_is_refused_by_name(tmp_path):
    path = tmp_path / "twice.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("t.one", 1)
    w.add_uint32("t.two", 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    path.write_bytes(path.read_bytes().replace(b"t.two", b"t.one"))
    with pytest.raises(LlmcoreError) as e:
        loaders.GGUFFile(path)
    assert "not a valid GGUF file" in e.value.message and "'t.one' twice" in e.value.message
