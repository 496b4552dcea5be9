"""Core ML through llmcore's backend conformance kit, as `--plugins coreml,xnnpack`.

The pip wheel's runtime has no Core ML backend: parity is skipped with the reason, and
--strict-parity refuses to write. Option values Core ML does not know fail cleanly.
"""

from llmcore.testing.conformance import BackendConformance


class TestCoreMLConformance(BackendConformance):
    backend = "coreml"
    runs_here = False
    fallbacks = ("xnnpack",)
    bad_options = [
        {"compute_units": "gpu_only"},
        {"precision": "int8"},
        {"minimum_deployment_target": "iOS99"},
    ]
