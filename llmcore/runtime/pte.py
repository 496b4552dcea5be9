"""Reading `.pte` programs: the one place llmcore parses ExecuTorch's serialized format.

A `.pte` is a flatbuffer program table (methods, values, operators, delegates) followed by
data segments (weights, delegate blobs). Everything here reads the table only, never the
segments, and it is the only module that touches ExecuTorch's private
``executorch.exir._serialize``; an ExecuTorch upgrade that moves it breaks one file.

* :func:`check_header` and :func:`read_head` refuse what is not a program, or is cut short,
  in one line;
* :func:`read_methods` walks the table (milliseconds even for a large model) and gives each
  method's operators, delegates, instructions, inputs and outputs, and the values of
  constant methods; :func:`operators`, :func:`delegate_ids` and :func:`constant_methods`
  read the few fields loading a program needs. All of them read with the ``flatbuffers``
  package alone: ExecuTorch's generated classes cannot be imported without its compiler
  (seconds; see the section);
* :func:`read_program_table` unpacks the whole table into ``executorch.exir.schema``
  dataclasses (seconds for a large model): the authority the tests check the rest against;
  :func:`delegate_payloads` reads the segments too, for backends' tests.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from llmcore.errors import LlmcoreError

HEAD_BYTES = 64
"""Enough of a file for the flatbuffer identifier and the extended header."""

_DTYPES = {
    "BYTE": "uint8", "CHAR": "int8", "SHORT": "int16", "INT": "int32", "LONG": "int64",
    "HALF": "float16", "FLOAT": "float32", "DOUBLE": "float64", "BOOL": "bool",
    "BFLOAT16": "bfloat16", "QINT8": "qint8", "QUINT8": "quint8", "QINT32": "qint32", "UINT16": "uint16",
    "UINT32": "uint32", "UINT64": "uint64",
}


# ---- the header ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtendedHeader:
    """ExecuTorch's extended header: 8 bytes into the file, after the flatbuffer's root
    offset and identifier, the magic ``eh00``, its own length (u32), then the program
    table's size, where the data segments start and (in a header of 32 bytes or more) their
    size, each a little-endian u64 (ExecuTorch's "PTE file format" documentation)."""

    program_size: int
    segment_base_offset: int
    segment_data_size: int


_EXTENDED_HEADER = struct.Struct("<4sIQQQ")


def _extended_header(head: Any) -> Optional[ExtendedHeader]:
    """The extended header of a file starting with ``head``; None when it has none."""
    raw = bytes(head[8 : 8 + _EXTENDED_HEADER.size])
    if len(raw) < _EXTENDED_HEADER.size:
        return None
    magic, length, program_size, segment_base_offset, segment_data_size = _EXTENDED_HEADER.unpack(raw)
    if magic != b"eh00" or length < 24:
        return None
    return ExtendedHeader(program_size, segment_base_offset, segment_data_size if length > 24 else 0)


def table_size(head: Any, file_size: int) -> int:
    """How many bytes from the start of the file the program table takes (the whole file
    when it has no extended header)."""
    header = _extended_header(head)
    return header.program_size if header is not None else file_size


def check_header(head: Any, label: str, file_size: Optional[int] = None, *, stage: str) -> None:
    """Refuse a file that is not an ExecuTorch program (no ``ET`` + two digits flatbuffer
    identifier) or is shorter than its extended header says. ``head`` is the start of the
    file (or all of it); ``file_size`` defaults to ``len(head)``."""
    file_size = len(head) if file_size is None else file_size
    start = bytes(head[:8])
    if len(start) < 8 or start[4:6] != b"ET" or not start[6:8].isdigit():
        raise LlmcoreError(
            f"{label!r} is not an ExecuTorch program: its header has no 'ET..' identifier "
            f"({file_size} bytes, starting {start!r}).",
            stage=stage,
            fix="pass a .pte file written by `llmcore export`.",
        )
    header = _extended_header(head)
    if header is None:
        return
    expected = max(header.program_size, header.segment_base_offset + header.segment_data_size)
    if file_size < expected:
        raise LlmcoreError(
            f"{label!r} is truncated: its header says {expected} bytes, the file has {file_size}.",
            stage=stage,
            fix="copy or export it again (an interrupted transfer or a full disk cuts files short).",
        )


def read_head(path: str | Path, *, stage: str) -> bytes:
    """The start of a `.pte` up to the end of its program table (the weights that follow are
    not read), or a one-line error if it is missing, not a program or cut short."""
    path = Path(path)
    label = str(path)
    if not path.is_file():
        raise LlmcoreError(f"program {label!r} does not exist.", stage=stage, fix="check the path of the .pte file.")
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(HEAD_BYTES)
            check_header(head, label, size, stage=stage)
            return head + f.read(max(0, table_size(head, size) - len(head)))
    except OSError as exc:
        raise LlmcoreError(
            f"cannot read {label!r}: {exc.strerror or exc}.", stage=stage, fix="check the file's permissions."
        ) from None


# ---- the table, through the flatbuffer accessors ---------------------------------------------


@dataclass
class ValueInfo:
    """A method input or output as a user sees it."""

    kind: str
    """``tensor``, ``int``, ``bool``, ``float``, ``str``, ``list`` or ``none``."""
    dtype: Optional[str] = None
    shape: Optional[list[int]] = None
    dynamic: Optional[str] = None
    """``None`` for a static shape, else ``bound`` (sizes are upper bounds) or ``unbound``."""

    def text(self) -> str:
        if self.kind != "tensor":
            return self.kind
        if self.dynamic == "bound":
            dims = ", ".join(str(d) if d == 1 else f"<={d}" for d in self.shape or [])
        else:
            dims = ", ".join(str(d) for d in self.shape or [])
        suffix = " (unbounded)" if self.dynamic == "unbound" else ""
        return f"{self.dtype}[{dims}]{suffix}"


@dataclass(frozen=True)
class Instruction:
    kind: str
    """``kernel``, ``delegate``, or ``other`` (moves, jumps, frees)."""
    name: str = ""
    """The operator (``aten::add.out``) of a kernel call, the backend id of a delegate call."""


@dataclass
class Method:
    """One method (execution plan) of a program."""

    name: str
    operators: list[str]
    """The method's operator table, ``namespace::op.overload`` as the runtime registers them."""
    delegates: list[str]
    """The backend id of each of its delegates."""
    chains: list[list[Instruction]]
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    constants: Optional[list] = field(default=None)
    """The values a constant method returns (outputs only: no inputs, operators or
    delegates), else None, as :func:`constant_methods` reads them."""


def read_methods(data: Any) -> list[Method]:
    """Every method of a serialized program (``bytes``, or a mapping of the file); only the
    program table is read, without ExecuTorch's compiler (below). Raises what the
    flatbuffer accessor raises on a damaged table."""
    plans = _plans(data)
    constants = _constants_of(plans)
    return [_method(plan, constants) for plan in plans]


def _method(plan: "_Table", constants: dict[str, list]) -> Method:
    """One method; ``constants``: the program's constant methods' values (:func:`_constants_of`)."""
    from flatbuffers import number_types as n

    operators = [_operator_name(op) for op in plan.tables(_PLAN_OPERATORS)]
    delegates = [d.string(_DELEGATE_ID) for d in plan.tables(_PLAN_DELEGATES)]
    chains = []
    for chain in plan.tables(_PLAN_CHAINS):
        instructions = []
        for instruction in chain.tables(_CHAIN_INSTRUCTIONS):
            kind, args = instruction.scalar(_INSTRUCTION_TYPE, n.Uint8Flags), instruction.table(_INSTRUCTION_ARGS)
            if kind == _KERNEL_CALL and args is not None:
                instructions.append(Instruction("kernel", operators[args.scalar(_CALL_INDEX, n.Int32Flags)]))
            elif kind == _DELEGATE_CALL and args is not None:
                instructions.append(Instruction("delegate", delegates[args.scalar(_CALL_INDEX, n.Int32Flags)]))
            else:
                instructions.append(Instruction("other"))
        chains.append(instructions)
    values = plan.tables(_PLAN_VALUES)
    name = plan.string(_PLAN_NAME)
    return Method(
        name=name,
        operators=operators,
        delegates=delegates,
        chains=chains,
        inputs=[_value_info(values[i]) for i in plan.scalars(_PLAN_INPUTS, n.Int32Flags)],
        outputs=[_value_info(values[i]) for i in plan.scalars(_PLAN_OUTPUTS, n.Int32Flags)],
        constants=constants.get(name),
    )


def _evalue(value: "_Table") -> tuple[int, Optional["_Table"]]:
    """An EValue's member of the KernelTypes union: its type number and its table."""
    from flatbuffers import number_types as n

    return value.scalar(_EVALUE_TYPE, n.Uint8Flags), value.table(_EVALUE_VAL)


def _value_info(value: "_Table") -> ValueInfo:
    from flatbuffers import number_types as n

    kind, val = _evalue(value)
    if kind == _TENSOR and val is not None:
        number = val.scalar(_TENSOR_SCALAR_TYPE, n.Int8Flags)
        scalar = _SCALAR_TYPES.get(number, str(number))
        return ValueInfo(
            kind="tensor",
            dtype=_DTYPES.get(scalar, scalar.lower()),
            shape=[int(d) for d in val.scalars(_TENSOR_SIZES, n.Int32Flags)],
            dynamic={0: None, 1: "bound", 2: "unbound"}.get(int(val.scalar(_TENSOR_SHAPE_DYNAMISM, n.Int8Flags))),
        )
    kinds = {_NULL: "none", _INT: "int", _BOOL: "bool", _DOUBLE: "float", _STRING: "str"}
    return ValueInfo(kind=kinds.get(kind, "list"))


# ---- what loading a program asks, without ExecuTorch's compiler -------------------------------
#
# Program.load asks every program which operators it calls, which backends its delegates need
# and what its constant methods return; `llmcore inspect` and `profile` ask for its methods.
# ExecuTorch's generated flatbuffer classes live in `executorch.exir`, and importing anything
# there imports the compiler (torch._dynamo, inductor), which took several times as long as
# the rest of loading SmolLM2 (docs/performance.md, "Measurements behind the code"). The
# fields are read with the `flatbuffers` package's table accessor instead, by their field
# numbers in ExecuTorch's schema (executorch/exir/_serialize/program.fbs, scalar_type.fbs);
# tests/test_pte.py checks every reader here against ExecuTorch's own unpacking of exported
# programs (read_program_table), and constant_methods against the values they were given.

_PROGRAM_EXECUTION_PLAN = 1  # table Program
_PLAN_NAME, _PLAN_VALUES, _PLAN_INPUTS, _PLAN_OUTPUTS, _PLAN_CHAINS, _PLAN_OPERATORS, _PLAN_DELEGATES = (
    0, 2, 3, 4, 5, 6, 7)  # table ExecutionPlan
_CHAIN_INSTRUCTIONS = 2  # table Chain
_INSTRUCTION_TYPE, _INSTRUCTION_ARGS = 0, 1  # table Instruction { instr_args: InstructionArguments }
_KERNEL_CALL, _DELEGATE_CALL = 1, 2  # union InstructionArguments { KernelCall, DelegateCall, MoveCall, ... }
_CALL_INDEX = 0  # KernelCall.op_index, DelegateCall.delegate_index
_OPERATOR_NAME, _OPERATOR_OVERLOAD = 0, 1  # table Operator
_DELEGATE_ID = 0  # table BackendDelegate
_EVALUE_TYPE, _EVALUE_VAL = 0, 1  # table EValue { val: KernelTypes } (a union: its type, then the table)
_ITEMS = 0  # the only field of Int, Bool, Double, String, IntList, DoubleList and BoolList
# union KernelTypes { Null, Int, Bool, Double, Tensor, String, IntList, DoubleList, BoolList, ... }:
# a union's type numbers its members from 1 (0 is no value)
_NULL, _INT, _BOOL, _DOUBLE, _TENSOR, _STRING, _INT_LIST, _DOUBLE_LIST, _BOOL_LIST = 1, 2, 3, 4, 5, 6, 7, 8, 9
_TENSOR_SCALAR_TYPE, _TENSOR_SIZES, _TENSOR_SHAPE_DYNAMISM = 0, 2, 8  # table Tensor
_SCALAR_TYPES = {  # enum ScalarType
    0: "BYTE", 1: "CHAR", 2: "SHORT", 3: "INT", 4: "LONG", 5: "HALF", 6: "FLOAT", 7: "DOUBLE", 11: "BOOL",
    12: "QINT8", 13: "QUINT8", 14: "QINT32", 15: "BFLOAT16", 16: "QUINT4X2", 17: "QUINT2X4", 22: "BITS16",
    23: "FLOAT8E5M2", 24: "FLOAT8E4M3FN", 25: "FLOAT8E5M2FNUZ", 26: "FLOAT8E4M3FNUZ", 27: "UINT16", 28: "UINT32",
    29: "UINT64",
}


class _Table:
    """One flatbuffer table, its fields asked for by number."""

    def __init__(self, buf: bytes, pos: int):
        from flatbuffers.table import Table

        self._t = Table(buf, pos)

    def _field(self, number: int) -> int:
        return self._t.Offset(4 + 2 * number)  # 0: absent

    def string(self, number: int) -> str:
        o = self._field(number)
        return self._t.String(o + self._t.Pos).decode() if o else ""

    def scalar(self, number: int, flags: Any, default: Any = 0) -> Any:
        o = self._field(number)
        return self._t.Get(flags, o + self._t.Pos) if o else default

    def table(self, number: int) -> Optional["_Table"]:
        o = self._field(number)
        return _Table(self._t.Bytes, self._t.Indirect(o + self._t.Pos)) if o else None

    def tables(self, number: int) -> list["_Table"]:
        o = self._field(number)
        if not o:
            return []
        start = self._t.Vector(o)
        return [_Table(self._t.Bytes, self._t.Indirect(start + 4 * i)) for i in range(self._t.VectorLen(o))]

    def scalars(self, number: int, flags: Any) -> list:
        o = self._field(number)
        if not o:
            return []
        start = self._t.Vector(o)
        return [self._t.Get(flags, start + flags.bytewidth * i) for i in range(self._t.VectorLen(o))]


def _plans(data: Any) -> list[_Table]:
    from flatbuffers import encode, packer

    buf = bytes(data[: table_size(data, len(data))])
    return _Table(buf, encode.Get(packer.uoffset, buf, 0)).tables(_PROGRAM_EXECUTION_PLAN)


def _plan_value(values: list[_Table], index: int) -> Any:
    """Value ``index`` of a constant method (``values``: the method's), in Python."""
    from flatbuffers import number_types as n

    kind, val = _evalue(values[index])
    if val is None:
        return None
    if kind == _INT:
        return int(val.scalar(_ITEMS, n.Int64Flags))
    if kind == _BOOL:
        return bool(val.scalar(_ITEMS, n.BoolFlags, False))
    if kind == _DOUBLE:
        return float(val.scalar(_ITEMS, n.Float64Flags, 0.0))
    if kind == _STRING:
        return val.string(_ITEMS)
    if kind == _BOOL_LIST:
        return [bool(v) for v in val.scalars(_ITEMS, n.BoolFlags)]
    if kind == _DOUBLE_LIST:
        return [float(v) for v in val.scalars(_ITEMS, n.Float64Flags)]
    if kind == _INT_LIST:  # items index other values
        return [_plan_value(values, int(i)) for i in val.scalars(_ITEMS, n.Int64Flags)]
    return None


def operators(data: Any) -> list[str]:
    """Operators a serialized program calls outside its delegates (each once, in order), as
    the runtime registers them (``aten::add.out``)."""
    return list(dict.fromkeys(_operator_name(op) for plan in _plans(data) for op in plan.tables(_PLAN_OPERATORS)))


def _operator_name(op: _Table) -> str:
    name, overload = op.string(_OPERATOR_NAME), op.string(_OPERATOR_OVERLOAD)
    return f"{name}.{overload}" if overload else name


def delegate_ids(data: Any) -> list[str]:
    """Backend ids of the delegates a serialized program carries (each once, in order)."""
    return list(dict.fromkeys(d.string(_DELEGATE_ID) for plan in _plans(data) for d in plan.tables(_PLAN_DELEGATES)))


def constant_methods(data: Any) -> dict[str, list]:
    """Constant method name -> the values it returns (``get_max_seq_len`` -> ``[2048]``): the
    methods with outputs, no inputs and nothing to call."""
    return _constants_of(_plans(data))


def _constants_of(plans: list[_Table]) -> dict[str, list]:
    """:func:`constant_methods` of a table already parsed (``plans``: its methods)."""
    from flatbuffers import number_types as n

    constants = {}
    for plan in plans:
        if plan.tables(_PLAN_OPERATORS) or plan.tables(_PLAN_DELEGATES) or plan.scalars(_PLAN_INPUTS, n.Int32Flags):
            continue
        outputs = plan.scalars(_PLAN_OUTPUTS, n.Int32Flags)
        if outputs:
            values = plan.tables(_PLAN_VALUES)
            constants[plan.string(_PLAN_NAME)] = [_plan_value(values, int(i)) for i in outputs]
    return constants


# ---- the whole table ------------------------------------------------------------------------


def read_program_table(data: Any) -> Any:
    """The program's flatbuffer table unpacked (``executorch.exir.schema.Program``), without
    its data segments: methods, values, operators and delegates, but not the weights."""
    from executorch.exir._serialize import _program

    size = table_size(data, len(data))
    try:
        from executorch.exir._serialize._flatbuffer_program import _flatbuffer_to_program
    except ImportError:  # an older wheel: the public path restores the segments too
        program = _program.deserialize_pte_binary(bytes(data))
        return getattr(program, "program", program)
    return _flatbuffer_to_program(bytes(data[:size]))


def delegate_payloads(data: Any) -> list[tuple[str, bytes]]:
    """``(backend_id, processed_bytes)`` for every delegate of every method, in order (the
    whole file: the delegates' blobs are in its segments)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte_file = deserialize_pte_binary(bytes(data))
    program = getattr(pte_file, "program", pte_file)
    out = []
    for plan in program.execution_plan:
        for delegate in plan.delegates:
            # deserialize_pte_binary moves segment data back inline.
            out.append((delegate.id, bytes(program.backend_delegate_data[delegate.processed.index].data)))
    return out
