"""XNNPACK through llmcore's backend conformance kit (llmcore.testing.conformance).

XNNPACK is in the pip wheel's runtime, so the kit checks parity too: the tiny fp32
programs must match eager PyTorch within 1e-4 (observed ~1e-5) with the same argmax.
"""

from llmcore.testing.conformance import BackendConformance


class TestXnnpackConformance(BackendConformance):
    backend = "xnnpack"
    runs_here = True
    parity_tolerance = 1e-4
