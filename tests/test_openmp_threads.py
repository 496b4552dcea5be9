"""How the commands that run programs (``export``, ``run``, ``chat``, ``serve``, ``eval``,
``profile``) set up OpenMP before torch starts, each case in a fresh interpreter (the setting
is read once, when torch loads OpenMP); and that a decode loop starts no OpenMP team of its
own in a process that set nothing up."""

import json
import os
import subprocess
import sys

import pytest
import torch

PROBE = """
import json, os, sys
from llmcore.cli import one_openmp_thread_per_worker, torch_on_every_core
if {torch_first}:
    import torch
limited = one_openmp_thread_per_worker()
import torch
from llmcore.runtime import torch_threads_after_custom_ops
before = torch.get_num_threads()
if limited:
    torch_on_every_core()
with torch_threads_after_custom_ops():
    during = torch.get_num_threads()
print(json.dumps(dict(limited=limited, omp=os.environ.get("OMP_NUM_THREADS"), before=before,
                      after=torch.get_num_threads(), during=during, cores=len(os.sched_getaffinity(0)))))
"""


def _probe(torch_first=False, omp=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    done = subprocess.run([sys.executable, "-c", PROBE.format(torch_first=torch_first)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_workers_keep_to_one_thread_and_the_main_thread_gets_every_core():
    got = _probe()
    assert got["limited"] and got["omp"] == "1"
    assert got["before"] == 1  # what OMP_NUM_THREADS=1 gives torch
    assert got["after"] == got["cores"]  # torch_on_every_core
    assert got["during"] == got["cores"]  # after the custom ops: the workers started no teams


@pytest.mark.parametrize("case", [dict(omp="3"), dict(torch_first=True)])
def test_an_explicit_setting_or_a_torch_already_started_is_left_alone(case):
    got = _probe(**case)
    assert not got["limited"]
    assert got["omp"] == case.get("omp")
    if got["omp"] != "1" and got["after"] > 1:
        assert got["during"] == 1  # torch_on_one_thread: the workers may start teams of their own


COMMAND_PROBE = """
import json, os, sys
import llmcore.cli as cli

def report(args):
    import torch
    print(json.dumps(dict(omp=os.environ.get("OMP_NUM_THREADS"), threads=torch.get_num_threads())))
    return 0

real_parser = cli.build_parser
def parser_running_report():  # the command's own function replaced, after its set-up ran
    parser = real_parser()
    parse = parser.parse_args
    def parse_args(argv=None):
        args = parse(argv)
        args.func = report
        return args
    parser.parse_args = parse_args
    return parser
cli.build_parser = parser_running_report
sys.exit(cli.main({argv!r}))
"""


@pytest.mark.parametrize(
    "argv, main_thread_on_every_core",
    [
        (["export", "--model", "nanogpt"], True),  # calibration and quantizer searches
        (["eval", "x.pte", "--text", "t.txt"], True),  # its eager reference model
        (["run", "x.pte", "--prompt", "hi"], False),
        (["chat", "x.pte"], False),
        (["serve", "x.pte"], False),
        (["profile", "x.pte"], False),
    ],
)
def test_each_command_that_runs_a_program_sets_it_up(argv, main_thread_on_every_core):
    """The command itself, in a fresh interpreter: the workers' setting reaches the
    environment of the process (a child inherits it). The main thread keeps every core
    where the command runs eager PyTorch, and one thread where it decodes (chat and serve
    once kept every core: SmolLM2 decoded 1.5x slower there than in ``llmcore run``)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", COMMAND_PROBE.format(argv=argv)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"omp": "1", "threads": len(os.sched_getaffinity(0)) if main_thread_on_every_core else 1}


COPY_PROBE = """
import json, os
import numpy, torch
torch.set_num_threads(2)
from llmcore.runtime.program import _own_last_row

def threads():
    return len(os.listdir("/proc/self/task"))

row = torch.from_numpy(numpy.random.default_rng(0).random(49152, dtype=numpy.float32))  # SmolLM2's logits
before = threads()
copy = _own_last_row(row)
after_own_last_row = threads()
row.clone()  # ATen's copy, as the bindings' clone_outputs=True makes it
print(json.dumps(dict(before=before, after_own_last_row=after_own_last_row, after_aten_clone=threads(),
                      equal=bool(torch.equal(copy, row)), shared=copy.data_ptr() == row.data_ptr())))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="OpenMP starts no team on one core")
def test_the_logits_copy_starts_no_openmp_team():
    """A program's logits row is copied without ATen's parallel copy, which starts OpenMP's
    team; its helper then spins beside the runtime's pool for the next forward call (SmolLM2
    decoded at 74-119 tok/s instead of 182-202 in a script that set no threads up). The
    ATen clone after it shows that the probe sees a team start."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", COPY_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["equal"] and not got["shared"]
    assert got["after_own_last_row"] == got["before"]
    assert got["after_aten_clone"] > got["before"]


def test_logits_stay_as_returned_after_the_next_call(exports):
    """The runtime writes every call's logits into the same memory; what ``Program.logits``
    returned is a copy, so the next call does not change it."""
    from llmcore.runtime import Program

    program = Program.load(exports("xnnpack").pte)
    first = program.logits([5, 6, 7], 0)
    kept = first.clone()
    second = program.logits([100], 3)
    assert not torch.equal(second, kept)  # the calls' logits differ, so an alias would show
    assert torch.equal(first, kept)


def test_read_logits_lends_the_row_the_next_call_overwrites(exports):
    """``Program.read_logits`` hands ``read`` the logits where the runtime left them (no
    copy): the same values ``logits`` copies, in memory the next call writes again."""
    import numpy as np

    from llmcore.runtime import Program

    program = Program.load(exports("xnnpack").pte)
    owned = program.logits([5, 6, 7], 0)
    lent = program.read_logits([5, 6, 7], 0, lambda row: row)
    assert isinstance(lent, np.ndarray) and np.array_equal(lent, owned.numpy())
    seen = lent.copy()
    program.read_logits([100], 3, lambda row: None)
    assert not np.array_equal(lent, seen)  # the lent row was the program's output memory


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, seed=1), dict(temperature=0.7, top_p=0.9, seed=3)])
def test_generation_on_lent_rows_writes_what_copied_rows_write(exports, sampling):
    """``generate`` samples from the lent row (``read_logits``): it writes the same tokens as
    a loop over copied logits (what a program with only ``logits`` gets), greedy and sampled."""
    from llmcore.runtime.generate import Sampling, generate
    from llmcore.runtime import Program

    program = Program.load(exports("xnnpack").pte)

    class CopiesOnly:  # the same program behind ``logits`` alone
        def __init__(self, program):
            self.logits = program.logits
            for name in ("use_kv_cache", "max_seq_len", "max_context_len", "eos_ids"):
                setattr(self, name, getattr(program, name))

    lent = generate(program, [5, 6, 7], 12, Sampling(**sampling), stop_at_eos=False).generated_ids
    copied = generate(CopiesOnly(program), [5, 6, 7], 12, Sampling(**sampling), stop_at_eos=False).generated_ids
    assert lent == copied and len(lent) == 12


def test_generation_runs_its_tensor_ops_on_one_thread(exports):
    """``generate`` (and the server's loop) keep PyTorch's own ops on one thread while they
    decode, and give the caller's setting back after."""
    from llmcore.runtime.generate import Sampling, generate
    from llmcore.runtime import Program

    program = Program.load(exports("xnnpack").pte)
    seen = []
    read_logits = program.read_logits

    def recording(tokens, input_pos, read):
        seen.append(torch.get_num_threads())
        return read_logits(tokens, input_pos, read)

    program.read_logits = recording
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generate(program, [5, 6, 7], 4, Sampling(temperature=0.8, seed=1), stop_at_eos=False)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_row_numpy_cannot_hold_is_copied_by_torch():
    """bfloat16 has no numpy dtype: its row takes ATen's copy, on one thread."""
    from llmcore.runtime.program import _own_last_row

    row = torch.linspace(-3, 3, 40000).to(torch.bfloat16)
    copy = _own_last_row(row)
    assert copy.dtype == torch.bfloat16 and torch.equal(copy, row) and copy.data_ptr() != row.data_ptr()
