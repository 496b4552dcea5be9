"""One way every stage turns plugin failures into one-line errors: llmcore.errors.stage_errors."""

from __future__ import annotations

import pytest

from llmcore.errors import LlmcoreError, stage_errors
from llmcore.pipeline import emit
from llmcore.plugins import PluginInfo, Provided
from llmcore.records import PostPass


def test_a_plugin_s_own_error_keeps_its_message_and_fix():
    with pytest.raises(LlmcoreError) as caught:
        with stage_errors("transform", "myplugin", "source transform 'x' failed", fix="generic fix"):
            raise LlmcoreError("the model has no attention to swap.", fix="use another family.")
    exc = caught.value
    assert (exc.message, exc.fix, exc.stage, exc.plugin) == (
        "the model has no attention to swap.", "use another family.", "transform", "myplugin",
    )
    with pytest.raises(LlmcoreError) as caught:  # a stage and plugin it names stay
        with stage_errors("transform", "myplugin", "failed", fix="f"):
            raise LlmcoreError("m", stage="load", plugin="other")
    assert (caught.value.stage, caught.value.plugin) == ("load", "other")


def test_other_errors_become_one_line_naming_stage_and_plugin():
    with pytest.raises(LlmcoreError) as caught:
        fix = lambda exc: f"fix for {type(exc).__name__}"  # noqa: E731
        with stage_errors("quantize", "q", "quantizer recipe 'r' failed", fix=fix):
            raise ValueError("first line\nsecond line")
    exc = caught.value
    assert exc.one_line() == "[quantize/q] quantizer recipe 'r' failed: ValueError: first line. Fix: fix for ValueError"
    assert isinstance(exc.__cause__, ValueError)


def test_an_empty_message_gives_the_exception_type():
    with pytest.raises(LlmcoreError) as caught:
        with stage_errors("emit", None, "to_executorch failed", fix="f"):
            raise RuntimeError()
    assert caught.value.message == "to_executorch failed: RuntimeError"


def test_interrupts_pass_through():
    with pytest.raises(KeyboardInterrupt):
        with stage_errors("lower", "p", "lowering failed", fix="f"):
            raise KeyboardInterrupt


class _Edge:
    def transform(self, passes):
        for p in passes:
            p()
        return self


def _post_pass(create) -> Provided:
    return Provided(PostPass(name="my-pass", description="d", create=create), PluginInfo("myplugin", "ep"))


def test_post_pass_errors():
    """emit used to wrap a plugin's LlmcoreError again (losing its fix) and to fail with an
    IndexError on an exception without a message."""

    def own_error():
        raise LlmcoreError("the graph has no convolution to fuse.", fix="drop my-pass.")

    with pytest.raises(LlmcoreError) as caught:
        emit.apply_post_passes(_Edge(), [_post_pass(lambda: own_error)])
    assert caught.value.one_line() == "[post-passes/myplugin] the graph has no convolution to fuse. Fix: drop my-pass."

    def silent():
        raise RuntimeError("")

    with pytest.raises(LlmcoreError) as caught:
        emit.apply_post_passes(_Edge(), [_post_pass(lambda: silent)])
    assert caught.value.message == "post-pass 'my-pass' failed: RuntimeError"
    assert caught.value.plugin == "myplugin" and caught.value.stage == "post-passes"
