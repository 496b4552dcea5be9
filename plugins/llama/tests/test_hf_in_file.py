"""A Hugging Face safetensors folder left in its file for a recipe that reads it layer by layer
(issue 61: a bf16 folder to ``8da4w`` without the model in fp32).

Authorities: the same folder loaded as before (every tensor read by the safetensors package
and converted at load), whose tensors the file's reads must equal bit for bit, whole and by
rows, q/k rows in Meta's rotary order included; and ``8da4w`` run on that float model, whose
integers, scales and tables the recipe must give unchanged when it reads the file itself.
"""

from __future__ import annotations

import pytest
import torch

from llama_testutils import TINY, meta_state_dict, random_model, write_hf
from llmcore import stored
from llmcore.errors import LlmcoreError
from llmcore.records import LoadOptions
from llmcore_llama import loaders


def write_folder(folder, dtype, shards=1, tie=False):
    import dataclasses

    config = dataclasses.replace(TINY, tie_embeddings=tie)
    sd = {k: v.to(dtype) for k, v in meta_state_dict(random_model(config, std=0.05)).items()}
    write_hf(folder, sd, config, shards=shards)
    return folder


@pytest.mark.parametrize("dtype, shards, tie", [(torch.bfloat16, 1, True), (torch.float32, 2, False),
                                                (torch.float16, 1, False)])
def test_weights_left_in_the_file_read_as_the_float_load(tmp_path, dtype, shards, tie):
    folder = write_folder(tmp_path / "hf", dtype, shards, tie)
    options = LoadOptions(max_seq_len=64)
    floats = loaders.load_hf(folder, options).module.state_dict()
    loaded = loaders.load_hf(folder, LoadOptions(max_seq_len=64, weights_in_file=True))
    module = loaded.module
    matrices = {name for name, p in module.named_parameters() if p.dim() == 2}
    assert set(loaded.stored_weights) == matrices - ({"output.weight"} if tie else set())
    assert module.output.weight is module.tok_embeddings.weight if tie else True
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.dim() == 2:
            assert param.device.type == "meta" and stored.in_file(param), name
            rows = stored.float_rows(param)
            assert torch.equal(stored.floats(param), floats[name]), name
            assert torch.equal(rows[3:17], floats[name][3:17]), name  # q/k: a slice across heads' rotary rows
            assert rows[5:5].shape == (0, param.shape[1])
        else:
            assert torch.equal(param, floats[name]), name
    with pytest.raises(LlmcoreError, match="still in the checkpoint file"):
        module(torch.tensor([[1, 2, 3]]))


def test_a_model_runs_with_its_weights_in_the_file_one_module_at_a_time(tmp_path):
    folder = write_folder(tmp_path / "hf", torch.bfloat16, tie=True)
    expected = loaders.load_hf(folder, LoadOptions(max_seq_len=64)).module(torch.tensor([[1, 2, 3, 4]]))
    module = loaders.load_hf(folder, LoadOptions(max_seq_len=64, weights_in_file=True)).module
    held = []
    module.layers[1].feed_forward.w2.register_forward_hook(
        lambda m, _a, _o: held.append(sum(p.device.type != "meta" for p in module.parameters() if p.dim() == 2)))
    with torch.no_grad(), stored.read_while_running(module):
        logits = module(torch.tensor([[1, 2, 3, 4]]))
    assert torch.equal(logits, expected)
    assert held == [1]  # while w2 runs, its weight alone of the model's matrices is read
    assert all(p.device.type == "meta" for p in module.parameters() if p.dim() == 2)
    with pytest.raises(LlmcoreError, match="still in the checkpoint file"):
        module(torch.tensor([[1]]))


def test_rescaled_weight_in_the_file_reads_scaled(tmp_path):
    folder = write_folder(tmp_path / "hf", torch.bfloat16)
    module = loaders.load_hf(folder, LoadOptions(max_seq_len=64, weights_in_file=True)).module
    w = module.layers[0].attention.wv.weight
    before = stored.floats(w)
    rows, cols = torch.rand(w.shape[0]) + 0.5, torch.rand(w.shape[1]) + 0.5
    assert stored.rescale(w, cols=cols) and stored.rescale(w, rows=rows)
    assert torch.allclose(stored.floats(w), before * cols / rows.unsqueeze(1), rtol=1e-6, atol=0)
    assert torch.equal(stored.float_rows(w)[2:9], stored.floats(w)[2:9])
    assert not stored.rescale(torch.ones(3, 3), cols=torch.ones(3))  # a tensor in memory: the caller scales it


@pytest.mark.parametrize("tie", [True, False])
def test_8da4w_from_the_file_is_8da4w_of_the_float_model(tmp_path, tie):
    """Channel scales (folded into norms, v rows, o and MLP columns), activation-aware int4,
    the int8 output layer and the int8 table: the same integers and scales either way."""
    import llmcore_xnnpack
    from llmcore.pipeline.quantize import calibration_for
    from llmcore_xnnpack.recipes import quantize_8da4w

    recipe = next(r for r in llmcore_xnnpack.llmcore_quantizers() if r.name == "8da4w")
    assert recipe.reads_weights_in_file
    options = {key: default for key, (_, default, _) in recipe.options.items()}
    folder = write_folder(tmp_path / "hf", torch.bfloat16, tie=tie)
    ids = [int(t) % TINY.vocab_size for t in torch.randint(0, 10**6, (150,), generator=torch.Generator().manual_seed(3))]
    calibration = calibration_for(lambda _text: ids, 64, 64, False, "8da4w")
    results = []
    for in_file in (False, True):
        module = loaders.load_hf(folder, LoadOptions(max_seq_len=64, weights_in_file=in_file)).module
        quantize_8da4w(module, {**options, "int4_nibbles": in_file}, calibration)
        assert not any(stored.in_file(p) for p in module.parameters())
        if in_file:
            for layer in module.modules():
                if hasattr(layer, "unpack_"):
                    layer.unpack_()
        results.append(module.state_dict())
    # the float model's int8 table keeps its fp32 table readable beside it (for code that reads
    # it itself; the program does not); one read from the file is not read back for that
    del results[0]["tok_embeddings.weight"]
    assert results[0].keys() == results[1].keys()
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name


def test_a_file_cut_short_fails_at_load_in_one_line(tmp_path):
    folder = write_folder(tmp_path / "hf", torch.bfloat16)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(LlmcoreError, match="could not read .*model.safetensors as safetensors: .*beyond the end"):
        loaders.load_hf(folder, LoadOptions(max_seq_len=64, weights_in_file=True))


def run_counting_reads(tmp_path, tie: bool, weight_of):
    """The tiny folder's logits for a few tokens, as the float model gives them and run within
    :func:`llmcore.stored.read_while_running` from the file; and the row slices read of the
    weight ``weight_of(module)`` picks. Returns ``(expected, logits, reads, module)``."""
    import dataclasses

    folder = write_folder(tmp_path / "hf", torch.bfloat16, tie=tie)
    tokens = torch.tensor([[7, 3, 4, 90, 7, 5, 200]])
    expected = loaders.load_hf(folder, LoadOptions(max_seq_len=64)).module(tokens)
    module = loaders.load_hf(folder, LoadOptions(max_seq_len=64, weights_in_file=True)).module
    weight = weight_of(module)
    form = stored.record(weight)
    reads = []

    def counted(rows: slice) -> torch.Tensor:
        reads.append(rows)
        return form.read_floats(rows)

    stored.remember(weight, dataclasses.replace(form, read_floats=counted))
    with torch.no_grad(), stored.read_while_running(module):
        logits = module(tokens)
    return expected, logits, reads, module


def test_an_embedding_in_the_file_reads_only_the_rows_it_looks_up(tmp_path):
    """A calibration pass reads each module's weights as it runs; the token table's lookup
    needs only the rows of the ids it is given (a 1B's tied table is 1 GiB as floats). The
    logits stay those of the float model, and the table's other reads are the output
    layer's (tied: the same weight; larger than any layer's weight, so read by rows, here in
    one piece)."""
    expected, logits, reads, _ = run_counting_reads(tmp_path, True, lambda m: m.tok_embeddings.weight)
    assert torch.equal(logits, expected)
    assert reads == [slice(3, 6), slice(7, 8), slice(90, 91), slice(200, 201), slice(0, 320)]


@pytest.mark.parametrize("tie", [True, False])
def test_the_output_layer_is_computed_a_few_rows_at_a_time(tmp_path, tie, monkeypatch):
    """The weight larger than every layer's (the vocabulary's output layer) is never read
    whole in a pass over the model: its logits are computed from a few rows at a time, and
    are the float model's."""
    monkeypatch.setattr(stored, "ROWS_READ_BYTES", 100 * TINY.dim * 4)  # 100 rows a read
    expected, logits, reads, module = run_counting_reads(tmp_path, tie, lambda m: m.output.weight)
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    # (a tied table's lookups come first: the rows of the ids)
    assert reads[-4:] == [slice(0, 100), slice(100, 200), slice(200, 300), slice(300, 320)]
    assert all(r.stop - r.start <= 100 for r in reads)
    assert module.output.weight.device.type == "meta"
    assert module.output.forward.__func__ is torch.nn.Linear.forward  # its own forward again
    with pytest.raises(LlmcoreError, match="still in the checkpoint file"):  # outside the block, as before
        module(torch.tensor([[1]]))
