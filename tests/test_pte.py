"""llmcore.runtime.pte, the one reader of `.pte` programs: the header check, and the fast reading of
methods, operators, delegates and constant methods against ExecuTorch's own unpacking."""

from __future__ import annotations

import dataclasses

import pytest

from llmcore.runtime import libraries, pte
from llmcore.errors import LlmcoreError

CONSTANTS = {"get_n": 7, "flag": True, "ratio": 0.5, "ids": [3, 4, 5], "get_runtime_libraries": ["a_lib", "b_lib"]}


@pytest.fixture(scope="module")
def program() -> bytes:
    """A small program with a delegate, kernels outside it and constant methods of every kind."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.linear(x)) * 2 + 1

    exported = torch.export.export(Tiny().eval(), (torch.randn(2, 8),))
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()], constant_methods=CONSTANTS)
    return edge.to_executorch().buffer


def _unpacked_methods(data: bytes) -> list[pte.Method]:
    """The methods as ExecuTorch's own unpacking of the table gives them (its generated
    classes, through ``read_program_table``), in ``pte.Method`` terms, less constants."""
    from executorch.exir import schema

    kinds = {schema.Int: "int", schema.Bool: "bool", schema.Double: "float", schema.String: "str",
             schema.Null: "none"}
    dynamic = {schema.TensorShapeDynamism.STATIC: None, schema.TensorShapeDynamism.DYNAMIC_BOUND: "bound",
               schema.TensorShapeDynamism.DYNAMIC_UNBOUND: "unbound"}
    dtypes = {schema.ScalarType.FLOAT: "float32", schema.ScalarType.LONG: "int64", schema.ScalarType.INT: "int32",
              schema.ScalarType.HALF: "float16", schema.ScalarType.BOOL: "bool", schema.ScalarType.CHAR: "int8"}

    def value(plan, index):
        val = plan.values[index].val
        if isinstance(val, schema.Tensor):
            return pte.ValueInfo("tensor", dtypes[val.scalar_type], list(val.sizes), dynamic[val.shape_dynamism])
        return pte.ValueInfo(kinds.get(type(val), "list"))

    methods = []
    for plan in pte.read_program_table(data).execution_plan:
        ops = [f"{o.name}.{o.overload}" if o.overload else o.name for o in plan.operators]
        chains = []
        for chain in plan.chains:
            instructions = []
            for instruction in chain.instructions:
                args = instruction.instr_args
                if isinstance(args, schema.KernelCall):
                    instructions.append(pte.Instruction("kernel", ops[args.op_index]))
                elif isinstance(args, schema.DelegateCall):
                    instructions.append(pte.Instruction("delegate", plan.delegates[args.delegate_index].id))
                else:
                    instructions.append(pte.Instruction("other"))
            chains.append(instructions)
        methods.append(pte.Method(plan.name, ops, [d.id for d in plan.delegates], chains,
                                  [value(plan, i) for i in plan.inputs], [value(plan, i) for i in plan.outputs]))
    return methods


def test_methods_agree_with_executorch_s_unpacking(program):
    methods = pte.read_methods(program)
    assert [dataclasses.replace(m, constants=None) for m in methods] == _unpacked_methods(program)
    forward = next(m for m in methods if m.name == "forward")
    assert [v.text() for v in forward.inputs + forward.outputs] == ["float32[2, 8]", "float32[2, 8]"]
    assert forward.constants is None and "delegate" in {i.kind for i in forward.chains[0]}


def test_lists_and_constant_methods(program):
    assert pte.delegate_ids(program) == ["XnnpackBackend"]
    assert pte.operators(program) and all("::" in op for op in pte.operators(program))
    constants = pte.constant_methods(program)
    assert constants == {k: v if isinstance(v, list) else [v] for k, v in CONSTANTS.items()}
    assert libraries.declared_libraries(program) == ["a_lib", "b_lib"]
    assert libraries.program_operators(program) == pte.operators(program)


def test_the_readers_agree_with_executorch_s_unpacking_of_llms(exports):
    """Every reader here, which reads the table without ExecuTorch's compiler, against
    ExecuTorch's own unpacking of exported LLMs (a portable KV-cache program with
    ``llama::`` ops and dynamic shapes, an XNNPACK one, an int8 one); the constant values
    against those the export wrote."""
    sources = [exports(name).pte.read_bytes() for name in ("portable", "xnnpack", "int8")]
    for data in sources:
        methods, theirs = pte.read_methods(data), _unpacked_methods(data)
        assert [dataclasses.replace(m, constants=None) for m in methods] == theirs
        assert pte.operators(data) == list(dict.fromkeys(op for m in theirs for op in m.operators))
        assert pte.delegate_ids(data) == list(dict.fromkeys(d for m in theirs for d in m.delegates))
    assert any(op.startswith("llama::") for op in pte.operators(sources[0]))
    forward = next(m for m in pte.read_methods(sources[0]) if m.name == "forward")
    assert any(v.dynamic == "bound" for v in forward.inputs)  # the token ids: up to max_seq_len
    written = exports("portable").report["metadata_methods"]  # what the export put in the program
    assert {k: pte.constant_methods(sources[0])[k] for k in written} == {
        k: v if isinstance(v, list) else [v] for k, v in written.items()}


def test_the_extended_header_as_executorch_reads_it(program):
    from executorch.exir._serialize._program import _get_extended_header

    broken_magic = program[:8] + b"xx00" + program[12:]
    for head in (program, program[:64], program[:39], broken_magic, b"\0" * 64):
        ours, theirs = pte._extended_header(head), _get_extended_header(bytes(head))
        assert (ours is None) == (theirs is None), head[:16]
        if ours is not None:
            assert (ours.program_size, ours.segment_base_offset, ours.segment_data_size) == (
                theirs.program_size, theirs.segment_base_offset, theirs.segment_data_size)
    assert pte._extended_header(program) is not None


def test_only_the_program_table_is_read(program):
    """The head of the file up to its program table is enough for every list."""
    size = pte.table_size(program, len(program))
    assert size < len(program)  # the delegate's blob is in a segment after the table
    head = program[:size]
    assert pte.delegate_ids(head) == pte.delegate_ids(program)
    assert pte.constant_methods(head) == pte.constant_methods(program)


@pytest.mark.parametrize("stage", ["run", "inspect"])
def test_one_header_check_for_every_reader(program, stage, tmp_path):
    with pytest.raises(LlmcoreError, match="is truncated: its header says") as caught:
        pte.check_header(program[: len(program) // 2], "cut.pte", stage=stage)
    assert caught.value.stage == stage
    for bad in (b"", b"hello world, not a program", program[:4] + b"ETxy" + program[8:]):
        with pytest.raises(LlmcoreError, match="is not an ExecuTorch program"):
            pte.check_header(bad, "x.pte", stage=stage)
    pte.check_header(program, "ok.pte", stage=stage)
    path = tmp_path / "p.pte"
    path.write_bytes(program)
    assert pte.read_head(path, stage=stage) == program[: pte.table_size(program, len(program))]


def test_the_runtime_uses_the_strict_check(program):
    """``Program.load`` refuses what ``llmcore inspect`` refuses, before the runtime sees it."""
    from llmcore.runtime import Program

    with pytest.raises(LlmcoreError, match="is not an ExecuTorch program") as caught:
        Program.load(program[:4] + b"ETxy" + program[8:])
    assert caught.value.stage == "run"
    with pytest.raises(LlmcoreError, match="is truncated"):
        Program.load(program[:-10])
