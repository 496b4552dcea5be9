"""Settings for every test folder (tests/, plugins/*/tests, examples/).

With pytest-xdist (``make test`` runs one worker per core) each worker's torch gets its
share of the cores, not all of them: two workers each running two OpenMP threads on two
cores spend their time waiting on each other's spinning threads. Subprocesses a test starts
(the CLI, the C++ runner) set their own threads as they would for a user.
"""

import os


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // int(workers)))
