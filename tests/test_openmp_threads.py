"""How ``llmcore export`` and ``llmcore run`` set up OpenMP before torch starts, each case in
a fresh interpreter (the setting is read once, when torch loads OpenMP)."""

import json
import os
import subprocess
import sys

import pytest

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


def test_the_export_command_sets_it_up(tmp_path):
    """The command itself, as a subprocess: the workers' setting reaches the environment of
    the process (a child inherits it), the main thread keeps every core."""
    script = (
        "import os, sys, json\n"
        "import llmcore.cli as cli\n"
        "seen = {}\n"
        "def fake_export(args):\n"
        "    import torch\n"
        "    seen.update(omp=os.environ.get('OMP_NUM_THREADS'), threads=torch.get_num_threads())\n"
        "    print(json.dumps(seen))\n"
        "    return 0\n"
        "cli.cmd_export = fake_export  # what build_parser binds the command to\n"
        "sys.exit(cli.main(['export', '--model', 'nanogpt']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"omp": "1", "threads": len(os.sched_getaffinity(0))}
