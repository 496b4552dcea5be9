"""QNN through llmcore's backend conformance kit (llmcore.testing.conformance).

Registration and option checks run as for every backend. Lowering needs the Qualcomm AI
Engine Direct SDK that the executorch wheel was built against (QAIRT 2.37.0.250724),
which no package registry offers: without it, the lowering checks assert the one clear
error instead.
With ``QNN_SDK_ROOT`` at that SDK the kit's own lowering checks run.
"""

from __future__ import annotations

import pytest

from llmcore.errors import LlmcoreError
from llmcore.testing.conformance import BackendConformance, export_tiny
from llmcore_qnn.sdk import QNN_SDK_VERSION, check_sdk


def _sdk_ready() -> bool:
    try:
        check_sdk()
        return True
    except LlmcoreError:
        return False


class TestQnnConformance(BackendConformance):
    backend = "qnn"
    # The pip runtime registers QnnBackend (it runs QNN programs on x86 through the SDK's HTP
    # simulator libraries), so the kit checks parity wherever lowering works.
    runs_here = True
    bad_options = [{"soc_model": "SM0000"}]

    def _family(self, family: str):
        if _sdk_ready():
            return super()._family(family)
        with pytest.raises(LlmcoreError) as info:
            export_tiny(self.backend, family, cache=False)
        text = info.value.one_line()
        assert info.value.stage == "lower" and QNN_SDK_VERSION in text and "QNN_SDK_ROOT" in text, text
