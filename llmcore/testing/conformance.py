"""A conformance kit for llmcore backend plugins.

Every backend package runs the same checks in its own tests:

1. **registration**: ``llmcore plugins --json`` (a fresh process, so the entry point is
   what is tested) lists the plugin, installed from a distribution, with the
   ``llmcore_partitioners`` hook and the backend among what it provides;
2. **lowering**: the tiny nanoGPT and the tiny Llama export through
   :func:`llmcore.pipeline.export` with ``--plugins <backend>[,<fallbacks>]``; the report
   names the backend, its delegates hold the transformer's matrix multiplications (at
   least one matmul-like operator per linear layer of the transformer blocks), and the
   written program carries delegates with the backend's id;
3. **parity**: checked against eager PyTorch when this ExecuTorch runtime has the
   backend, otherwise skipped with a reason that names the backend id and where it runs;
   ``--strict-parity`` then refuses to write the program;
4. **options**: an unknown ``--backend-option`` and a value of the wrong type fail with
   :class:`~llmcore.errors.LlmcoreError` naming the option; so does every known-bad value
   the plugin lists.

Use it as a base class (pytest collects the inherited tests)::

    from llmcore.testing.conformance import BackendConformance

    class TestVulkanConformance(BackendConformance):
        backend = "vulkan"
        runs_here = False              # the pip runtime has no Vulkan backend
        fallbacks = ("xnnpack",)       # --plugins vulkan,xnnpack
        bad_options = [{"precision": "int3"}]

or call :func:`check_backend` (everything at once) or the ``check_*`` functions one by
one. Exports are cached per process, so a plugin's own tests can reuse them through
:func:`export_tiny`.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from llmcore.errors import LlmcoreError

TINY_FAMILIES = ("nanogpt", "llama")
TINY_CONFIG = "tiny"

# Operator names (as the report writes them: ``aten_addmm_default``,
# ``et_vk_linear_q8ta_q8csw_default``) that are a matrix multiplication.
_MATMUL = re.compile(r"linear|matmul|(^|_)(add|b)?mm(_|$)|int8pack_mm")

_cache: dict = {}
_registry = None
_workdir: Optional[Path] = None


# ---- helpers ---------------------------------------------------------------------------


def registry():
    """The installed plugins (loaded once per process)."""
    global _registry
    if _registry is None:
        from llmcore.plugins import load_registry

        _registry = load_registry()
    return _registry


def backend_record(backend: str):
    """The ``Backend`` record and the plugin that provides it."""
    provided = registry().get("backends", backend, stage="conformance")
    return provided.record, provided.plugin


def _folder() -> Path:
    global _workdir
    if _workdir is None:
        _workdir = Path(tempfile.mkdtemp(prefix="llmcore-conformance-"))
        atexit.register(shutil.rmtree, _workdir, True)
    return _workdir


def runtime_has(runtime_id: str) -> bool:
    """Whether this process's ExecuTorch runtime registers the backend id."""
    from llmcore.runtime import registered_backends

    try:
        return runtime_id in registered_backends()
    except Exception:
        return False


def matmul_count(operators: Mapping[str, int]) -> int:
    """How many matrix-multiplication operators an operator count holds."""
    return sum(n for name, n in operators.items() if _MATMUL.search(name))


def transformer_linear_layers(family: str, config: str = TINY_CONFIG) -> int:
    """The ``nn.Linear`` layers of a family's model that are not tied to an embedding
    table (those of the transformer blocks, and an untied output layer)."""
    import torch

    from llmcore.records import LoadOptions

    fam = registry().get("model_families", family, stage="conformance").record
    module = fam.build_random(config, LoadOptions(config=config)).module
    tables = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    return sum(
        1 for m in module.modules() if isinstance(m, torch.nn.Linear) and id(m.weight) not in tables
    )


def tiny_model(family: str, seed: int = 0):
    """The tiny config of ``family`` as a :class:`~llmcore.records.LoadedModel` (random
    weights from ``seed``)."""
    from llmcore.records import LoadOptions

    fam = registry().get("model_families", family, stage="conformance").record
    return fam.build_random(TINY_CONFIG, LoadOptions(config=TINY_CONFIG, seed=seed))


def calibration_of(loaded):
    """The :class:`~llmcore.records.Calibration` a calibrated recipe receives for ``loaded``
    (a model without its KV cache yet, so one call of up to ``max_seq_len`` tokens): for
    quantizing an eager twin the way the pipeline quantizes the exported model."""
    from llmcore.runtime.generate import TextTokenizer
    from llmcore.pipeline import text_ids
    from llmcore.pipeline.quantize import calibration_for

    tokenizer, meta = TextTokenizer(loaded.tokenizer.json_text), loaded.metadata
    return calibration_for(lambda text: text_ids(tokenizer, text, meta), meta.max_seq_len, meta.max_seq_len,
                           False, "test")


def transformed_tiny(
    family: str,
    plugins: Sequence[str],
    *,
    transforms: Sequence[str] = (),
    skip_transforms: Sequence[str] = (),
    max_seq_len: Optional[int] = None,
    seed: int = 0,
):
    """The tiny model after the source transforms an export with ``--plugins plugins``
    would apply (selected and ordered by the pipeline's own rules).

    Returns ``(module, context, applied)``: the eager module in eval mode, the
    :class:`~llmcore.records.TransformContext` with the calling convention the transforms
    left (``context.use_kv_cache``, ``context.convention``) and the names of the transforms
    applied, in order.
    """
    from llmcore.pipeline import transform
    from llmcore.recipe import ExportOptions
    from llmcore.records import TransformContext

    options = ExportOptions(
        model=family, output="unused.pte", config=TINY_CONFIG, plugins=list(plugins),
        transforms=list(transforms), skip_transforms=list(skip_transforms),
    )
    chosen = transform.select_transforms(options, registry(), family)
    loaded = tiny_model(family, seed)
    meta = loaded.metadata
    context = TransformContext(
        metadata=meta, max_seq_len=max_seq_len or meta.max_seq_len, family=family, backends=tuple(plugins)
    )
    applied, convention = transform.apply_transforms(loaded, chosen, context)
    return loaded.module.eval(), dataclasses.replace(context, convention=convention), applied


def diff_from_tiny(module, family: str, *, seed: int = 0, **options) -> float:
    """How far ``module`` (``family``'s tiny model from :func:`transformed_tiny`) moves the
    logits from the untransformed tiny model: :func:`~llmcore.testing.equivalence.max_logit_diff`,
    which takes ``options`` (``use_kv_cache``, ``lengths``)."""
    from llmcore.testing.equivalence import max_logit_diff

    loaded = tiny_model(family, seed)
    return max_logit_diff(module, loaded.module.eval(), vocab_size=loaded.metadata.vocab_size, **options)


def export_tiny(
    backend: str,
    family: str,
    *,
    fallbacks: Sequence[str] = (),
    quantize: Optional[str] = None,
    quantize_options: Optional[Mapping[str, Any]] = None,
    backend_options: Optional[Mapping[str, Any]] = None,
    transforms: Sequence[str] = (),
    skip_transforms: Sequence[str] = (),
    max_seq_len: Optional[int] = None,
    strict_parity: Optional[float] = None,
    cache: bool = True,
    output: Optional[Path] = None,
):
    """Export the tiny config of ``family`` with ``--plugins backend,*fallbacks``
    (in process); returns the :class:`~llmcore.pipeline.ExportResult`. Results are
    cached per process by their options."""
    from llmcore.pipeline import export
    from llmcore.recipe import ExportOptions

    key = json.dumps(
        [backend, family, list(fallbacks), quantize, dict(quantize_options or {}), dict(backend_options or {}),
         list(transforms), list(skip_transforms), max_seq_len, strict_parity],
        sort_keys=True,
        default=str,
    )
    if cache and key in _cache:
        return _cache[key]
    out = output or Path(tempfile.mkdtemp(prefix=f"{backend}-{family}-", dir=_folder())) / f"{family}.pte"
    options = ExportOptions(
        model=family,
        config=TINY_CONFIG,
        output=str(out),
        plugins=[backend, *fallbacks],
        quantize=quantize,
        quantize_options=dict(quantize_options or {}),
        backend_options={backend: dict(backend_options)} if backend_options else {},
        transforms=list(transforms),
        skip_transforms=list(skip_transforms),
        max_seq_len=max_seq_len,
        strict_parity=strict_parity,
        quiet=True,
    )
    result = export(options, registry())
    if cache:
        _cache[key] = result
    return result


# ---- the checks ------------------------------------------------------------------------


def check_registration(backend: str) -> dict:
    """``llmcore plugins --json`` lists the plugin that provides ``backend``, found through
    its entry point, with its hooks. Returns that plugin's entry."""
    proc = subprocess.run(
        [sys.executable, "-m", "llmcore", "plugins", "--json"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"`llmcore plugins --json` failed: {proc.stderr[-2000:]}"
    data = json.loads(proc.stdout)
    failed = [f for f in data["failed"] if backend in (f["name"], f.get("entry_point", ""))]
    assert not failed, f"the plugin of backend {backend!r} failed to load: {failed}"
    owners = [p for p in data["plugins"] if backend in p["provides"].get("backends", [])]
    assert len(owners) == 1, f"expected one plugin providing backend {backend!r}, found {owners}"
    entry = owners[0]
    assert entry["distribution"], f"plugin {entry['name']!r} is not installed from a distribution (entry point)"
    assert "llmcore_partitioners" in entry["hooks"], f"plugin {entry['name']!r} lists hooks {entry['hooks']}"
    conflicts = [c for c in data["conflicts"] if c["name"] == backend]
    assert not conflicts, f"backend {backend!r} is provided twice: {conflicts}"
    return entry


def check_export(
    backend: str,
    family: str,
    *,
    runs_here: Optional[bool] = None,
    fallbacks: Sequence[str] = (),
    parity_tolerance: float = 1e-3,
    min_matmuls: Optional[int] = None,
    **export_options,
):
    """Export the tiny ``family`` and check delegation, the program and parity.

    ``runs_here`` states whether this runtime can run the backend's delegates (``None``:
    ask the runtime); a plugin that states it is checked against the runtime.
    ``min_matmuls`` defaults to :func:`transformer_linear_layers` of the family.
    """
    from llmcore.runtime.pte import delegate_ids

    record, _plugin = backend_record(backend)
    runtime_id = record.runtime_id
    assert runtime_id, f"backend {backend!r} declares no runtime_id"
    has = runtime_has(runtime_id)
    if runs_here is None:
        runs_here = has
    assert runs_here == has, (
        f"backend {backend!r}: the test says runs_here={runs_here}, but this runtime "
        f"{'has' if has else 'lacks'} {runtime_id}"
    )
    result = export_tiny(backend, family, fallbacks=fallbacks, **export_options)
    report = result.report

    names = [b["name"] for b in report["backends"]]
    assert names[: 1 + len(fallbacks)] == [backend, *fallbacks], f"report backends: {names}"
    assert report["backends"][0]["runtime_id"] == runtime_id

    by_backend = report["delegation"]["by_backend"]
    assert runtime_id in by_backend, (
        f"{backend} ({runtime_id}) got no delegate for {family}; delegates: {sorted(by_backend)}"
    )
    entry = by_backend[runtime_id]
    assert entry["delegates"] >= 1
    want = transformer_linear_layers(family) if min_matmuls is None else min_matmuls
    got = matmul_count(entry["operators"])
    assert got >= want, (
        f"{backend} delegates of {family} hold {got} matmul-like operators, expected at least {want} "
        f"(one per linear layer of the transformer); they hold: {entry['operators']}"
    )

    pte = Path(result.pte)
    assert pte.is_file(), f"{pte} was not written"
    assert runtime_id in delegate_ids(pte.read_bytes()), f"{pte} carries no {runtime_id} delegate"

    parity = report["parity"]
    if runs_here:
        assert "skipped" not in parity, f"parity was skipped although the runtime has {runtime_id}: {parity}"
        assert parity["max_abs_diff"] <= parity_tolerance, f"{backend}/{family} parity: {parity}"
        assert parity["top1_agreement"] == 1.0, f"{backend}/{family} parity: {parity}"
    else:
        reason = parity.get("skipped", "")
        assert reason, f"parity of a {runtime_id} program was not skipped here: {parity}"
        assert runtime_id in reason and runtime_id in parity.get("missing_backends", []), reason
        if record.runs_on:
            assert record.runs_on in reason, f"the skip reason does not say where {runtime_id} runs: {reason}"
    return result


def check_strict_parity_refused(backend: str, family: str = "nanogpt", *, fallbacks: Sequence[str] = ()) -> LlmcoreError:
    """For a backend this runtime cannot run: ``--strict-parity`` fails (stage parity, the
    reason given) and nothing is written."""
    record, _ = backend_record(backend)
    out = Path(tempfile.mkdtemp(prefix=f"{backend}-strict-", dir=_folder())) / f"{family}.pte"
    try:
        result = export_tiny(backend, family, fallbacks=fallbacks, strict_parity=1.0, cache=False, output=out)
    except LlmcoreError as exc:
        assert exc.stage == "parity", exc.one_line()
        assert "strict-parity" in exc.message and record.runtime_id in exc.message, exc.one_line()
        left = sorted(p.name for p in out.parent.iterdir())
        assert not left, f"a refused export left files behind: {left}"
        return exc
    raise AssertionError(f"--strict-parity with a skipped check wrote {result.pte}")


def _fails_on_option(backend: str, options: Mapping[str, Any], *, family: str = "nanogpt") -> LlmcoreError:
    try:
        result = export_tiny(backend, family, backend_options=options, cache=False)
    except LlmcoreError as exc:
        return exc
    raise AssertionError(f"backend {backend!r} accepted options {dict(options)} and wrote {result.pte}")


def check_unknown_option(backend: str) -> LlmcoreError:
    """An option the backend does not declare fails before anything runs, naming it."""
    exc = _fails_on_option(backend, {"no_such_option_xyz": 1})
    assert "no_such_option_xyz" in exc.message, exc.one_line()
    assert exc.stage == "options", exc.one_line()
    return exc


def check_wrong_types(backend: str) -> list[LlmcoreError]:
    """Each declared option, given a value of the wrong type, fails naming the option."""
    record, _ = backend_record(backend)
    errors = []
    for name, (typ, _default, _help) in record.options.items():
        wrong: Any = [1, 2]  # a list is no option's type
        exc = _fails_on_option(backend, {name: wrong})
        assert name in exc.message, exc.one_line()
        errors.append(exc)
    return errors


def check_bad_options(backend: str, bad_options: Iterable[Mapping[str, Any]]) -> list[LlmcoreError]:
    """Each set of known-bad option values fails with an LlmcoreError naming an option."""
    errors = []
    for options in bad_options:
        exc = _fails_on_option(backend, options)
        text = exc.one_line()
        assert any(name in text for name in options), f"{dict(options)}: the error names none of them: {text}"
        errors.append(exc)
    return errors


def check_backend(
    backend: str,
    *,
    families: Sequence[str] = TINY_FAMILIES,
    runs_here: Optional[bool] = None,
    fallbacks: Sequence[str] = (),
    bad_options: Iterable[Mapping[str, Any]] = (),
    parity_tolerance: float = 1e-3,
) -> dict:
    """Run every check; returns what was seen (the plugin entry and the reports)."""
    entry = check_registration(backend)
    reports = {
        family: check_export(
            backend, family, runs_here=runs_here, fallbacks=fallbacks, parity_tolerance=parity_tolerance
        ).report
        for family in families
    }
    check_unknown_option(backend)
    check_wrong_types(backend)
    check_bad_options(backend, bad_options)
    record, _ = backend_record(backend)
    if not runtime_has(record.runtime_id):
        check_strict_parity_refused(backend, families[0], fallbacks=fallbacks)
    return {"plugin": entry, "reports": reports}


# ---- pytest ----------------------------------------------------------------------------


class BackendConformance:
    """Subclass as ``Test<Name>Conformance`` and set ``backend`` (and ``runs_here``)."""

    backend: str = ""
    runs_here: Optional[bool] = None
    families: Sequence[str] = TINY_FAMILIES
    fallbacks: Sequence[str] = ()
    bad_options: Sequence[Mapping[str, Any]] = ()
    parity_tolerance: float = 1e-3

    def _family(self, family: str):
        import pytest

        if family not in self.families:
            pytest.skip(f"{self.backend} does not claim family {family}")
        return check_export(
            self.backend,
            family,
            runs_here=self.runs_here,
            fallbacks=self.fallbacks,
            parity_tolerance=self.parity_tolerance,
        )

    def test_registers_through_entry_point(self):
        check_registration(self.backend)

    def test_lowers_tiny_nanogpt(self):
        self._family("nanogpt")

    def test_lowers_tiny_llama(self):
        self._family("llama")

    def test_unknown_option_fails_cleanly(self):
        check_unknown_option(self.backend)

    def test_wrong_option_types_fail_cleanly(self):
        check_wrong_types(self.backend)

    def test_known_bad_option_values_fail_cleanly(self):
        check_bad_options(self.backend, self.bad_options)

    def test_strict_parity_refuses_a_skipped_check(self):
        import pytest

        record, _ = backend_record(self.backend)
        if runtime_has(record.runtime_id):
            pytest.skip(f"this runtime runs {record.runtime_id}: parity is checked, not skipped")
        check_strict_parity_refused(self.backend, self.families[0], fallbacks=self.fallbacks)
