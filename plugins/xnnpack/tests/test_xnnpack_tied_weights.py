"""nanoGPT ties ``lm_head.weight`` to ``transformer.wte.weight``: the fp32 program must
hold that 257 x 64 table once, not once for the embedding and once more inside the XNNPACK
delegate (ExecuTorch's default, kept behind ``share_tied_weights=false``)."""

from __future__ import annotations

import torch

from llmcore.runtime import Program
from llmcore_nanogpt.model import CONFIGS, GPT

TABLE_BYTES = 257 * 64 * 4


def tiny() -> GPT:
    return GPT(CONFIGS["tiny"]).init_random(0).eval()


def table_copies(pte_path) -> int:
    """How many times the tied table's fp32 bytes appear in the program file."""
    table = tiny().transformer.wte.weight.detach().contiguous().numpy().tobytes()
    assert len(table) == TABLE_BYTES
    return pte_path.read_bytes().count(table)


def test_tied_table_is_stored_once(xnnpack_exports):
    result = xnnpack_exports("fp32")
    assert table_copies(result.pte) == 1
    # The output layer is the one linear left to the runtime's `linear` kernel.
    rows = {r["op_type"]: r for r in result.report["delegation"]["operators"]}
    assert rows["aten_linear_default"]["not_delegated"] == 1
    assert rows["aten_linear_default"]["delegated"] == 12  # 2 blocks x (q, k, v, c_proj, c_fc, c_proj)


def test_without_sharing_the_table_is_stored_twice(xnnpack_exports):
    shared = xnnpack_exports("fp32").report["outputs"]["pte_bytes"]
    duplicated = xnnpack_exports("fp32-duplicate")
    assert table_copies(duplicated.pte) == 2
    assert duplicated.report["outputs"]["pte_bytes"] - shared >= TABLE_BYTES


def test_shared_table_program_matches_eager(xnnpack_exports):
    """fp32 bound as in the core parity tests: 1e-4 (observed ~1e-5)."""
    program = Program.load(xnnpack_exports("fp32").pte)
    model = tiny()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 257, (1, 40), generator=gen)
    for length in (1, 17, 40):
        got = program.logits(tokens[0, :length].tolist(), 0)
        with torch.no_grad():
            expected = model(tokens[:, :length])[0]
        assert (got - expected).abs().max().item() <= 1e-4
    program.logits(tokens[0, :32].tolist(), 0)
    for pos in range(32, 40):
        got = program.logits([int(tokens[0, pos])], pos)
        with torch.no_grad():
            expected = model(tokens[:, : pos + 1])[0]
        assert (got - expected).abs().max().item() <= 1e-4


def test_quantized_output_layer_is_not_held_back(xnnpack_exports):
    """With 8da4w the output layer has its own int4 weight: XNNPACK takes it as usual."""
    rows = {r["op_type"]: r for r in xnnpack_exports("8da4w").report["delegation"]["operators"]}
    assert rows["aten_linear_default"]["not_delegated"] == 0


def test_table_shared_through_two_parameters_is_stored_once():
    """Two Parameter objects over one storage export as two placeholders: still one table."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from torch import nn

    from llmcore_xnnpack.partition import SharedTablePartitioner

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(300, 64)
            self.proj = nn.Linear(64, 64)
            self.out_weight = nn.Parameter(self.emb.weight.data)  # same storage, another Parameter

        def forward(self, tokens):
            h = self.proj(self.emb(tokens))
            return torch.nn.functional.linear(h[:, -1, :], self.out_weight)

    torch.manual_seed(0)
    model = Toy().eval()
    tokens = torch.randint(0, 300, (1, 5))
    exported = torch.export.export(model, (tokens,))
    assert sum(n.op == "placeholder" for n in exported.graph.nodes) == 5  # emb, out_weight, proj x2, tokens
    edge = to_edge_transform_and_lower(
        exported,
        partitioner=[SharedTablePartitioner(per_op_mode=False)],
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
    )
    data = edge.to_executorch().buffer
    assert data.count(model.emb.weight.detach().numpy().tobytes()) == 1
    got = Program.load(data).module.run_method("forward", [tokens])[0]
    with torch.no_grad():
        assert (got - model(tokens)).abs().max().item() <= 1e-5

