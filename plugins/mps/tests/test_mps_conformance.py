"""MPS through llmcore's backend conformance kit, as `--plugins mps,xnnpack`.

The pip wheel's runtime has no MPS backend: parity is skipped with the reason, and
--strict-parity refuses to write.
"""

from llmcore.testing.conformance import BackendConformance


class TestMPSConformance(BackendConformance):
    backend = "mps"
    runs_here = False
    fallbacks = ("xnnpack",)
