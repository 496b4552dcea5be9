"""A Ctrl-C that library code swallows still stops the export at the end of the stage.

ExecuTorch 1.5.1's lowering runs a bare ``except:`` per operator; a SIGINT landing there
was lost and the export finished (seen once in CI as ``ctrl-c-during-lower`` exiting 0).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from llmcore.progress import StageLog, remembered_interrupts


def _swallowing_library_call() -> None:
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the handler runs here and raises KeyboardInterrupt ...
    except:  # noqa: E722  ... which a bare except (as in the library) swallows
        pass


def test_swallowed_interrupt_is_raised_at_the_end_of_the_stage():
    log = StageLog(quiet=True)
    after = []
    with pytest.raises(KeyboardInterrupt):
        with remembered_interrupts():
            with log.stage("lower"):
                _swallowing_library_call()
                after.append("the stage went on")
            after.append("the next stage started")
    assert after == ["the stage went on"]


def test_handler_is_restored_and_nothing_is_remembered_afterwards():
    before = signal.getsignal(signal.SIGINT)
    with remembered_interrupts():
        pass
    assert signal.getsignal(signal.SIGINT) is before
    with StageLog(quiet=True).stage("emit"):
        pass  # no stale interrupt
