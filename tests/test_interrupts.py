"""Ctrl-C during an export stops it at the next safe point, and ends the process killed by SIGINT.

A KeyboardInterrupt raised wherever the signal landed could abort the process inside torch's
C++ (seen once in CI as ``ctrl-c-during-lower`` ending with -6, SIGABRT), or be swallowed by
ExecuTorch 1.5.1's lowering, whose bare ``except:`` runs for every operator (seen once as
``ctrl-c-during-lower`` exiting 0). And an interrupted command ends killed by SIGINT wherever
the Ctrl-C landed (seen once in CI as ``ctrl-c-during-lower`` ending with -2 where 130 was
expected).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from llmcore.progress import StageLog, interrupts_at_safe_points, stop_if_interrupted


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)  # the Python handler runs at the next bytecode, well within this


def test_the_first_ctrl_c_lets_the_step_finish_and_stops_at_the_end_of_the_stage(capfd):
    log = StageLog(quiet=True)
    after = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_at_safe_points():
            with log.stage("lower"):
                _ctrl_c()
                after.append("the stage went on")
            after.append("the next stage started")
    assert after == ["the stage went on"]
    assert "[llmcore] Ctrl-C: stopping at the end of this step" in capfd.readouterr().err


def test_a_second_ctrl_c_stops_at_once():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_at_safe_points():
            _ctrl_c()
            reached.append("after the first")
            _ctrl_c()
            reached.append("after the second")
    assert reached == ["after the first"]


def test_a_second_ctrl_c_that_library_code_swallowed_still_stops_at_the_end_of_the_stage():
    after = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_at_safe_points():
            with StageLog(quiet=True).stage("lower"):
                _ctrl_c()
                try:
                    _ctrl_c()
                except:  # noqa: E722  (as ExecuTorch's lowering does for each operator)
                    pass
                after.append("the stage went on")
    assert after == ["the stage went on"]


def test_a_module_read_from_the_file_is_a_safe_point():
    """During a calibration pass over weights still in the checkpoint, Ctrl-C stops the pass
    before the next module's read, not after the whole model."""
    from llmcore import stored

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for index, layer in enumerate(model):
        values = layer.weight.detach().clone()
        stored.remember(layer.weight, stored.FileWeight("F32", f"{index}.weight", tuple(values.shape),
                                                        lambda rows, values=values: values[rows].clone()))
    ran = []
    model[0].register_forward_hook(lambda *_: (ran.append(0), _ctrl_c()))
    model[1].register_forward_hook(lambda *_: ran.append(1))
    with pytest.raises(KeyboardInterrupt):
        with interrupts_at_safe_points(), stored.read_while_running(model):
            model(torch.ones(1, 4))
    assert ran == [0]


def test_handler_is_restored_and_nothing_is_remembered_afterwards():
    before = signal.getsignal(signal.SIGINT)
    with interrupts_at_safe_points():
        pass
    assert signal.getsignal(signal.SIGINT) is before
    with StageLog(quiet=True).stage("emit"):
        pass  # no stale interrupt
    stop_if_interrupted()


# A command interrupted where the KeyboardInterrupt reaches ``main`` directly, and one where
# it first passes through ``exec`` of a string (as inside dataclasses or sympy during an
# export): run with ``python -m`` (as the tests run llmcore), Python 3.11 ends the second
# killed by SIGINT even after ``main`` caught it and returned 130.
_INTERRUPTED_COMMAND = """
import os, signal, sys
import llmcore.cli as cli

# Ctrl-C raises KeyboardInterrupt even where SIGINT was inherited as ignored (a shell's
# `cmd &`), as llmcore's own handler does for a second Ctrl-C (progress.interrupts_at_safe_points).
signal.signal(signal.SIGINT, signal.default_int_handler)

def interrupted(argv=None):
    try:
        if sys.argv[1] == "exec":
            exec("os.kill(os.getpid(), signal.SIGINT)\\nimport time\\ntime.sleep(5)")
        else:
            os.kill(os.getpid(), signal.SIGINT)
            import time
            time.sleep(5)
    except KeyboardInterrupt:
        print("llmcore: interrupted; nothing was written.", file=sys.stderr)
        return cli.EXIT_INTERRUPTED

cli.main = interrupted
raise SystemExit(cli.console_main())
"""


@pytest.mark.parametrize("through", ["exec", "direct"])
def test_an_interrupted_command_ends_killed_by_sigint_wherever_the_interrupt_landed(through, tmp_path):
    (tmp_path / "interrupted_command.py").write_text(_INTERRUPTED_COMMAND)
    done = subprocess.run([sys.executable, "-m", "interrupted_command", through], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGINT, done.stderr
    assert done.stderr.strip().splitlines() == ["llmcore: interrupted; nothing was written."], done.stderr
