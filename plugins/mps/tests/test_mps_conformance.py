"""MPS through llmcore's backend conformance kit, as `--plugins mps,xnnpack`.

The pip wheel's runtime has no MPS backend: parity is skipped with the reason, and
--strict-parity refuses to write.
"""

import pytest

from llmcore.testing.conformance import BackendConformance

# ExecuTorch 1.5 removed MPS: there llmcore-mps refuses to import (and the main env does
# not install it), so this module skips; `make test-mps` runs it on executorch 1.4.1.
pytest.importorskip("llmcore_mps", exc_type=ImportError)


class TestMPSConformance(BackendConformance):
    backend = "mps"
    runs_here = False
    fallbacks = ("xnnpack",)
