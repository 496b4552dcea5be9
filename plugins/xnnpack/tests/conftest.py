"""Tiny nanoGPT exports for the XNNPACK plugin's tests, made once per session, in process."""

from __future__ import annotations

import pytest

TINY_VOCAB = 257

# name -> ExportOptions fields beyond model/config/output
VARIANTS = {
    "fp32": dict(plugins=["xnnpack"]),
    "fp32-duplicate": dict(plugins=["xnnpack"], backend_options={"xnnpack": {"share_tied_weights": False}}),
    "8da4w": dict(plugins=["xnnpack"], quantize="8da4w"),
    "8da4w-g128": dict(plugins=["xnnpack"], quantize="8da4w", quantize_options={"group_size": 128}),
    "8da4w-emb0": dict(plugins=["xnnpack"], quantize="8da4w", quantize_options={"embedding_bits": 0}),
    "8da4w-emb4": dict(plugins=["xnnpack"], quantize="8da4w", quantize_options={"embedding_bits": 4}),
    "8da4w-asymmetric": dict(plugins=["xnnpack"], quantize="8da4w", quantize_options={"asymmetric": True}),
    "8da8w": dict(plugins=["xnnpack"], quantize="8da8w"),
    "8da8w-one-row": dict(plugins=["xnnpack"], quantize="8da8w", quantize_options={"outlier_split": False}),
}


@pytest.fixture(scope="session")
def registry():
    from llmcore.plugins import load_registry

    return load_registry()


@pytest.fixture(scope="session")
def xnnpack_exports(tmp_path_factory, registry):
    """name -> ExportResult of the tiny nanoGPT, exported lazily, once per session."""
    from llmcore.pipeline import export
    from llmcore.recipe import ExportOptions

    folder = tmp_path_factory.mktemp("xnnpack-exports")
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            sub = folder / name
            sub.mkdir()
            options = ExportOptions(
                model="nanogpt", config="tiny", output=str(sub / f"{name}.pte"), quiet=True, **VARIANTS[name]
            )
            cache[name] = export(options, registry)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny_calibration(registry):
    """The calibration the tiny nanoGPT's ``8da4w`` export runs (llmcore's built-in text in
    the model's tokens, one call), for the unexported model: its eager twin then gets the
    scales the program got."""
    from llmcore.pipeline.load import load_model
    from llmcore.pipeline.plan import resolve_plan
    from llmcore.recipe import ExportOptions
    from llmcore.testing.conformance import calibration_of

    return calibration_of(load_model(resolve_plan(ExportOptions(model="nanogpt", config="tiny", output="unused.pte"), registry)))


@pytest.fixture(scope="session")
def recipe_defaults():
    """The 8da4w recipe's default options, as the pipeline fills them in."""
    import llmcore_xnnpack

    recipe = next(r for r in llmcore_xnnpack.llmcore_quantizers() if r.name == "8da4w")
    return {key: default for key, (_, default, _) in recipe.options.items()}
