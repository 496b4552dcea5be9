"""llmcore.checkpoints.check_state_dict: one message for tensors that do not fit a model."""

from __future__ import annotations

import pytest
import torch

from llmcore.checkpoints import check_state_dict
from llmcore.errors import LlmcoreError

MODEL = {"a.weight": torch.Size([4, 4]), "b.weight": (4,), **{f"l{i}.weight": (2,) for i in range(5)}}


def _error(loaded, **kwargs) -> LlmcoreError:
    with pytest.raises(LlmcoreError) as caught:
        check_state_dict(MODEL, loaded, plugin="fam", source="x.pt does not fit a fam model", fix="check it.", **kwargs)
    return caught.value


def test_a_fitting_state_dict_passes():
    check_state_dict(MODEL, {k: torch.zeros(s) for k, s in MODEL.items()}, plugin="fam", source="s", fix="f")


def test_missing_unexpected_and_misshapen_tensors_in_one_line():
    loaded = {"a.weight": torch.zeros(4, 5), "b.weight": torch.zeros(4), "extra": torch.zeros(1)}
    exc = _error(loaded)
    assert exc.stage == "load" and exc.plugin == "fam" and exc.fix == "check it."
    assert exc.message == (
        "x.pt does not fit a fam model: missing 5 tensor(s): l0.weight, l1.weight, l2.weight, ...; "
        "unexpected 1 tensor(s): extra; wrong shape for 1 tensor(s): a.weight (e.g. a.weight: [4, 5], expected [4, 4])."
    )


def test_names_are_given_as_the_file_names_them():
    loaded = {k: torch.zeros(s) for k, s in MODEL.items() if k != "b.weight"}
    exc = _error(loaded, file_name=lambda k: f"blk.{k}")
    assert exc.message == "x.pt does not fit a fam model: missing 1 tensor(s): blk.b.weight."
