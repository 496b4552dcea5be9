"""``llmcore matrix FILE``: every model x backend order x recipe of a YAML file, exported
through the normal pipeline as Ray tasks.

Who ships on-device models exports many programs on every release. A matrix file lists
the models, the backend orders and the quantize recipes; each combination (a *cell*) is
one ``llmcore export`` with the same stages, report and parity check as the command.

Ray is the engine, not something written here: each cell is a Ray task asking for one CPU
and the memory its export is estimated to need, so Ray runs as many at once as the
machine (or cluster) has room for; Ray retries a task whose worker died (``--retries``);
and a finished cell's files come back through Ray's object store, so workers on other
machines need no shared folder, and the driver writes them in place atomically (a killed
worker never leaves a half-written ``.pte``). Each report records a content hash of the
cell's inputs (checkpoint bytes, options, llmcore's and the plugins' versions): a cell
whose outputs are complete and whose hash matches is skipped, so an interrupted matrix
resumes where it stopped.

The file (keys of ``llmcore export``'s recipe files wherever export options go)::

    output: out/matrix                          # root folder of the outputs
    layout: "{model}/{backends}/{recipe}.pte"   # the default
    common: {max-seq-len: 256}                  # export options for every cell
    models:
      - {name: smollm2, checkpoint: SmolLM2-135M-Instruct.Q4_1.gguf}
      - {name: tiny-gpt, model: nanogpt, config: tiny}
    backends: [xnnpack, [vulkan, xnnpack], []]  # [] = the portable runtime only
    recipes:
      - none
      - int8-dynamic
      - {name: 8da4w-g32, quantize: 8da4w, quantize-options: {group_size: 32}}
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import string
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from llmcore import nesting
from llmcore.errors import LlmcoreError, describe
from llmcore.recipe import ExportOptions, build_options, parse_recipe, short_repr

DEFAULT_LAYOUT = "{model}/{backends}/{recipe}.pte"
LAYOUT_FIELDS = ("model", "backends", "recipe")
MATRIX_KEYS = ("output", "layout", "common", "models", "backends", "recipes")
SUMMARY_FILE = "matrix.json"
# Options a matrix sets itself (the output path from the layout, the backends from their
# axis) or that make no sense for a batch of exports.
NOT_IN_CELLS = ("output", "plugins", "etrecord", "print_graph", "quiet")
PORTABLE_LABEL = "portable"
# What an export needs beside its weights: Python with torch, ExecuTorch and a program in
# flight (a tiny model's export peak, rounded up), and how many bytes per fp32 weight byte
# it holds at its peak, for the hungriest recipe measured (int8-dynamic; ``benchmarks/
# bench_matrix.py --smollm2``, figures in docs/matrix.md): the factor errs on the safe side.
BASE_MEMORY = 768 * 2**20
MEMORY_PER_WEIGHT_BYTE = 4.5
TASK_PREFIX = "llmcore-export:"


@dataclass(frozen=True)
class Cell:
    """One export of the matrix."""

    model: str
    """The model's label (its ``name``, or one made from family and config or checkpoint)."""
    backends: tuple[str, ...]
    recipe: str
    """The recipe's label."""
    options: ExportOptions
    memory_bytes: int
    """Memory the export is estimated to need: what the Ray task asks for."""
    key: str = ""
    """Content hash of everything that decides the program (see :func:`content_key`)."""

    @property
    def backends_label(self) -> str:
        return backends_label(self.backends)

    @property
    def name(self) -> str:
        return cell_name(self.model, self.backends, self.recipe)

    @property
    def report_path(self) -> Path:
        output = Path(self.options.output)
        return output.with_name(output.stem + ".report.json")


def backends_label(order: tuple[str, ...]) -> str:
    return "+".join(order) or PORTABLE_LABEL


def cell_name(model: str, order: tuple[str, ...], recipe: str) -> str:
    return f"{model}/{backends_label(order)}/{recipe}"


@dataclass
class Matrix:
    root: Path
    cells: list[Cell]


# ---- the file and its expansion ----------------------------------------------------------


def _matrix_error(message: str, fix: str) -> LlmcoreError:
    return LlmcoreError(message, stage="matrix", fix=fix)


def _axis(data: dict, key: str, source: str) -> list:
    values = data.get(key)
    if not isinstance(values, list) or not values:
        raise _matrix_error(f"{source}: {key!r} must be a non-empty list, got {short_repr(values)}.",
                            fix=f"list the {key} to export, e.g. `{key}: [...]`.")
    return values


def _entry_options(entry: dict, where: str, source: str) -> tuple[Optional[str], dict[str, Any]]:
    """An axis entry: export options plus an optional ``name`` (its label in the layout)."""
    entry = dict(entry)
    name = entry.pop("name", None)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise _matrix_error(f"{source}: {where} has name {short_repr(name)}.", fix="give it a non-empty string name.")
    try:
        options = parse_recipe(entry, source=f"{source}, {where}")
    except LlmcoreError as exc:  # the recipe-file check, reported as the matrix's
        raise _matrix_error(exc.message, fix=exc.fix) from None
    for key in NOT_IN_CELLS:
        if key in options:
            raise _matrix_error(
                f"{source}: {where} sets {key.replace('_', '-')!r}, which the matrix decides.",
                fix={"output": "set the root with `output:` and the file names with `layout:`.",
                     "plugins": "list backend orders under `backends:`."}.get(key, f"drop {key!r}."),
            )
    return name, options


def _label(text: str) -> str:
    """A label that is safe as one path component."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-.") or "x"


def _model_label(options: dict[str, Any]) -> str:
    if options.get("checkpoint"):
        return _label(Path(options["checkpoint"]).name.split(".")[0])
    return _label("-".join(str(options[k]) for k in ("model", "config") if options.get(k)))


def _backend_order(value: Any, source: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _matrix_error(
            f"{source}: each entry of 'backends' is a backend order (a name, `a,b` or a list), "
            f"got {short_repr(value)}.",
            fix="write e.g. `backends: [xnnpack, [vulkan, xnnpack], []]`.",
        )
    return tuple(value)


def _layout(layout: Any, source: str) -> str:
    if not isinstance(layout, str) or not layout.endswith(".pte"):
        raise _matrix_error(f"{source}: 'layout' must be a path ending in .pte, got {short_repr(layout)}.",
                            fix=f"write e.g. `layout: {DEFAULT_LAYOUT!r}`.")
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(layout) if f is not None}
    except ValueError as exc:
        raise _matrix_error(f"{source}: 'layout' {layout!r} is not a format string ({exc}).",
                            fix="use {model}, {backends} and {recipe} in braces.") from None
    unknown = used - set(LAYOUT_FIELDS)
    if unknown:
        raise _matrix_error(f"{source}: 'layout' names {sorted(unknown)}, which the matrix does not know.",
                            fix="use only {model}, {backends} and {recipe}.")
    missing = set(LAYOUT_FIELDS) - used
    if missing:  # two cells would write one file
        raise _matrix_error(f"{source}: 'layout' leaves out {sorted(missing)}, so cells would share a file.",
                            fix="use all of {model}, {backends} and {recipe}.")
    return layout


def expand(data: Any, source: str = "matrix", root: Optional[str] = None) -> Matrix:
    """The cells of a parsed matrix file, in order models x backends x recipes.

    Every cell's options are checked here as ``llmcore export`` checks a recipe file, so a
    typo fails before anything starts. ``root`` overrides the file's ``output``."""
    if not isinstance(data, dict):
        raise _matrix_error(f"{source} must be a YAML mapping, got {type(data).__name__}.",
                            fix=f"write the keys {', '.join(MATRIX_KEYS)}.")
    unknown = [k for k in data if k not in MATRIX_KEYS]
    if unknown:
        raise _matrix_error(f"unknown key {short_repr(unknown[0])} in {source}.", fix=f"use one of: {', '.join(MATRIX_KEYS)}.")
    root_text = root or data.get("output")
    if not root_text:
        raise _matrix_error(f"{source} names no output folder.", fix="add `output: FOLDER`, or pass --output.")
    root_path = Path(str(root_text))
    layout = _layout(data.get("layout", DEFAULT_LAYOUT), source)
    common = data.get("common") or {}
    if not isinstance(common, dict):
        raise _matrix_error(f"{source}: 'common' must be a mapping of export options.", fix="write e.g. `common: {max-seq-len: 256}`.")
    _, common = _entry_options(common, "common", source)

    models = []
    for i, entry in enumerate(_axis(data, "models", source)):
        if not isinstance(entry, dict):
            raise _matrix_error(f"{source}: models[{i}] must be a mapping, got {short_repr(entry)}.",
                                fix="write e.g. `- {model: nanogpt, config: tiny}` or `- {checkpoint: FILE}`.")
        name, options = _entry_options(entry, f"models[{i}]", source)
        if not (options.get("model") or options.get("checkpoint")):
            raise _matrix_error(f"{source}: models[{i}] names neither a model family nor a checkpoint.",
                                fix="give it `model:` (with `config:`) or `checkpoint:`.")
        models.append((_label(name) if name else _model_label(options), options))
    orders = [_backend_order(v, source) for v in _axis(data, "backends", source)]
    recipes = []
    for i, entry in enumerate(_axis(data, "recipes", source)):
        if isinstance(entry, str):
            entry = {"quantize": entry}
        if not isinstance(entry, dict):
            raise _matrix_error(f"{source}: recipes[{i}] must be a recipe name or a mapping, got {short_repr(entry)}.",
                                fix="write e.g. `- int8-dynamic` or `- {name: g32, quantize: 8da4w, quantize-options: {group_size: 32}}`.")
        name, options = _entry_options(entry, f"recipes[{i}]", source)
        recipes.append((_label(name or options.get("quantize") or "none"), options))

    cells, outputs = [], {}
    for model_label, model_options in models:
        for order in orders:
            for recipe_label, recipe_options in recipes:
                both = sorted(set(model_options) & set(recipe_options))
                if both:
                    raise _matrix_error(
                        f"{source}: model {model_label!r} and recipe {recipe_label!r} both set {both[0]!r}.",
                        fix="set it in one of them, or in `common`.")
                name = cell_name(model_label, order, recipe_label)
                relative = layout.format(model=model_label, backends=backends_label(order), recipe=recipe_label)
                output = root_path / relative
                if output in outputs:
                    raise _matrix_error(f"{source}: cells {outputs[output]} and {name} both write {relative}.",
                                        fix="give the models or recipes distinct names.")
                outputs[output] = name
                # [] is the portable runtime here, not the CPU's default list an export gets
                # without --plugins (llmcore.pipeline.plan.choose_backends)
                merged = {**common, **model_options, **recipe_options, "plugins": list(order) or ["none"],
                          "quiet": True}
                try:
                    options = build_options(merged, {"output": str(output)})
                except LlmcoreError as exc:
                    raise _matrix_error(f"{source}, cell {name}: {exc.message}", fix=exc.fix) from None
                cells.append(Cell(model_label, order, recipe_label, options, estimate_memory(options)))
    return Matrix(root_path, cells)


def load_matrix(path: str, root: Optional[str] = None) -> Matrix:
    import yaml

    try:
        data = nesting.yaml_loads(Path(path).read_text(encoding="utf-8"), what=f"matrix {path!r}", stage="matrix",
                                  fix="list the models, backends and recipes one level deep (docs/matrix.md).")
    except OSError as exc:
        raise _matrix_error(f"cannot read matrix {path!r}: {exc.strerror or exc}.", fix="check the path.") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise _matrix_error(f"matrix {path!r} is not YAML text: {describe(exc, 200)}.",
                            fix="fix the YAML syntax (indentation, colons, quotes).") from None
    return expand(data, source=f"matrix {path!r}", root=root)


# ---- memory estimate and content hash ----------------------------------------------------


@functools.lru_cache(maxsize=None)
def fp32_weight_bytes(checkpoint: Optional[str]) -> int:
    """Bytes the checkpoint's weights take as fp32, which is what the export holds.

    A GGUF's tensors are counted from its header; other files are taken as 16-bit weights
    (a file of fp32 weights is over-estimated 2x, which errs on the safe side). Cached: every
    backend order and recipe of a model asks for the same checkpoint."""
    if not checkpoint:
        return 0  # random initialisation from a named config: small by design
    path = Path(checkpoint)
    if path.suffix == ".gguf" and path.is_file():
        try:
            from gguf import GGUFReader

            return 4 * sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)
        except Exception:  # an unreadable file fails its own cell, with the loader's message
            return 0
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path] if path.is_file() else []
    return 2 * sum(p.stat().st_size for p in files)


def estimate_memory(options: ExportOptions) -> int:
    return int(BASE_MEMORY + MEMORY_PER_WEIGHT_BYTE * fp32_weight_bytes(options.checkpoint))


def _file_digest(path: Path, cache: dict) -> str:
    if path not in cache:
        digest = hashlib.sha256()
        if path.is_dir():
            for child in sorted(p for p in path.rglob("*") if p.is_file()):
                digest.update(str(child.relative_to(path)).encode() + b"\0" + _file_digest(child, cache).encode())
        elif path.is_file():
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        else:
            digest.update(b"missing")  # the export fails and says so; the key just differs
        cache[path] = digest.hexdigest()
    return cache[path]


def installed_versions() -> dict[str, str]:
    """llmcore's version and every plugin distribution's (entry-point group ``llmcore``)."""
    from importlib.metadata import distributions

    from llmcore import __version__

    versions = {"llmcore": __version__}
    for dist in distributions():
        if any(ep.group == "llmcore" for ep in dist.entry_points):
            versions[dist.metadata["Name"]] = dist.version
    return dict(sorted(versions.items()))


def content_key(options: ExportOptions, versions: dict[str, str], cache: dict) -> str:
    """What decides a cell's program: its options (not where it is written), the bytes of
    its checkpoint, tokenizer and chat template file, and the installed llmcore and plugin
    versions."""
    fields = dataclasses.asdict(options)
    for key in ("output", "quiet"):
        fields.pop(key)
    inputs = {k: _file_digest(Path(fields[k]), cache) for k in ("checkpoint", "tokenizer", "chat_template")
              if fields[k]}
    blob = json.dumps({"options": fields, "inputs": inputs, "versions": versions},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def with_keys(matrix: Matrix) -> Matrix:
    versions, cache = installed_versions(), {}
    return Matrix(matrix.root, [dataclasses.replace(c, key=content_key(c.options, versions, cache))
                                for c in matrix.cells])


def completed_report(cell: Cell, perplexity_text: Optional[str] = None) -> Optional[dict]:
    """The cell's report if its outputs are all there and were made from the same inputs
    (and, when a perplexity is asked for, scored on the same text)."""
    try:
        report = nesting.loads(cell.report_path.read_text(), what=str(cell.report_path), stage="matrix")
        outputs = report["outputs"]
        record = report.get("matrix", {})
        if record.get("key") != cell.key:
            return None
        if perplexity_text and record.get("perplexity_text") != perplexity_text:
            return None
        if Path(cell.options.output).stat().st_size != outputs["pte_bytes"]:
            return None
        if not Path(outputs["tokenizer"]).is_file():
            return None
    except (OSError, ValueError, KeyError, TypeError, LlmcoreError):  # not a report llmcore wrote: export again
        return None
    return report


def text_digest(perplexity_text: Optional[str]) -> Optional[str]:
    """The content hash of a ``--perplexity`` text, which a complete cell's report must match."""
    return _file_digest(Path(perplexity_text), {}) if perplexity_text else None


def plan(matrix: Matrix, registry, digest: Optional[str]) -> list[tuple[Cell, Optional[dict], Optional[str]]]:
    """For each cell (with its content key): its report when it is complete (skipped), else
    the error it would stop with at once, else neither (to export). The dry run prints
    this; the run acts on it."""
    planned = []
    for cell in with_keys(matrix).cells:
        report = completed_report(cell, digest)
        planned.append((cell, report, None if report is not None else check_cell(cell, registry)))
    return planned


def check_cell(cell: Cell, registry) -> Optional[str]:
    """The one-line error ``llmcore export`` would stop with before loading anything (an
    unknown family, backend, recipe or transform; a recipe not meant for the backends; a
    checkpoint no loader of the family reads), or None: the export's own plan
    (:func:`llmcore.pipeline.plan.resolve_plan`). Such a cell fails at once, without a worker."""
    from llmcore.pipeline.plan import resolve_plan

    try:
        resolve_plan(cell.options, registry)
    except LlmcoreError as exc:
        return exc.one_line()
    return None


# ---- one cell, in a Ray worker -----------------------------------------------------------


def _remove_stale_scratch() -> None:
    """Scratch folders of workers that were killed (their pid is gone)."""
    for folder in Path(tempfile.gettempdir()).glob("llmcore-matrix-*-*"):
        pid = folder.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def export_cell(options: dict[str, Any], perplexity_text: Optional[str], tracker=None) -> dict[str, Any]:
    """Export one cell into a scratch folder and return its files' bytes and its report.

    Runs in a Ray worker (reused from cell to cell, so that torch and ExecuTorch are
    imported once per worker, not once per cell), or in this process for the benchmark's
    one-after-another baseline. An export error is a result, not an exception: Ray
    retries only the worker's death."""
    from llmcore.pipeline import export
    from llmcore.progress import peak_rss_mib, reset_peak_rss, return_free_memory

    if tracker is not None:  # waited for: a start sent just before the worker is killed still counts
        import ray

        ray.get(tracker.started.remote(options["output"]))
    _remove_stale_scratch()
    return_free_memory()  # what the worker's previous cell freed
    reset_peak_rss()  # this cell's peak, not the worker's
    scratch = Path(tempfile.mkdtemp(prefix=f"llmcore-matrix-{os.getpid()}-"))
    start = time.perf_counter()
    result: dict[str, Any] = {"pid": os.getpid(), "host": os.uname().nodename}
    try:
        final = Path(options["output"])
        local = dataclasses.replace(ExportOptions(**options), output=str(scratch / final.name))
        try:
            exported = export(local)
        except LlmcoreError as exc:
            return result | {"status": "failed", "error": exc.one_line(), "wall_s": time.perf_counter() - start}
        except MemoryError:
            return result | {"status": "failed", "wall_s": time.perf_counter() - start,
                             "error": "ran out of memory (MemoryError). Fix: give the cell more memory or a smaller --max-seq-len."}
        except Exception as exc:  # a bug, or a native library's failure: still one line per cell
            return result | {"status": "failed", "wall_s": time.perf_counter() - start,
                             "error": f"internal error: {describe(exc)}"}
        result["wall_s"] = time.perf_counter() - start
        result["peak_rss_mib"] = peak_rss_mib()
        if perplexity_text:
            from llmcore.apps.evaluate import evaluate

            try:
                scored = evaluate(str(local.output), perplexity_text, None, None, with_eager=False)
                result["perplexity"] = scored["program"]["perplexity"]
            except LlmcoreError as exc:  # the program stands; only its score is missing, and says why
                result["error"] = f"perplexity not scored: {exc.one_line()}"
        result["report"] = exported.report
        result["files"] = {p.name: p.read_bytes() for p in scratch.iterdir() if p.is_file()}
        result["status"] = "ok"
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_cell(cell: Cell, result: dict[str, Any], matrix_record: dict[str, Any]) -> None:
    """Write a finished cell's files where the layout puts them, all or none (the report
    records the matrix key, which makes the cell complete for a later run)."""
    from llmcore.pipeline import report as report_module
    from llmcore.pipeline.write import OutputBundle

    output = Path(cell.options.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    report = result["report"]
    report["options"]["output"] = str(output)
    report["outputs"].update(pte=str(output), report=str(cell.report_path),
                             tokenizer=str(output.with_name(Path(report["outputs"]["tokenizer"]).name)))
    report["matrix"] = matrix_record
    bundle = OutputBundle()
    try:
        for name, data in result["files"].items():
            if name.endswith(".report.json"):
                continue
            bundle.stage(output if name.endswith(".pte") else output.with_name(name), data)
        bundle.stage(cell.report_path, report_module.to_json(report))
        bundle.commit()
    finally:
        bundle.discard()


# ---- the run -----------------------------------------------------------------------------


@dataclass
class CellResult:
    cell: str
    status: str
    """``ok``, ``skipped`` (complete from an earlier run), ``failed``, or ``interrupted``
    (Ctrl-C came first: nothing of it was written)."""
    output: str
    wall_s: Optional[float] = None
    peak_rss_mib: Optional[float] = None
    pte_mib: Optional[float] = None
    parity_max_abs_diff: Optional[float] = None
    parity_top1: Optional[float] = None
    perplexity: Optional[float] = None
    attempts: int = 0
    """Workers that started the cell (more than one when a worker died and Ray retried)."""
    pid: Optional[int] = None
    host: Optional[str] = None
    error: Optional[str] = None
    key: str = ""

    @classmethod
    def of(cls, cell: Cell, status: str, **extra) -> "CellResult":
        return cls(cell=cell.name, status=status, output=cell.options.output, key=cell.key, **extra)

    @classmethod
    def failed(cls, cell: Cell, error: str, **extra) -> "CellResult":
        return cls.of(cell, "failed", error=error, **extra)

    @classmethod
    def from_report(cls, cell: Cell, status: str, report: dict, **extra) -> "CellResult":
        parity = report.get("parity", {})
        matrix = report.get("matrix", {})
        return cls.of(
            cell, status,
            wall_s=matrix.get("wall_s"), peak_rss_mib=matrix.get("peak_rss_mib"),
            pte_mib=report["outputs"]["pte_bytes"] / 2**20,
            parity_max_abs_diff=parity.get("max_abs_diff"), parity_top1=parity.get("top1_agreement"),
            perplexity=matrix.get("perplexity"), **extra,
        )


@dataclass
class Progress:
    """The live line: cells done / running / failed, elapsed, and an estimate."""

    total: int
    done: int = 0
    failed: int = 0
    skipped: int = 0
    running: int = 0
    start: float = field(default_factory=time.perf_counter)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        finished = self.done + self.failed
        left = self.total - finished - self.skipped
        estimate = ""
        if finished and left:
            estimate = f", about {elapsed / finished * left:.0f}s left"
        return (f"[llmcore matrix] {finished + self.skipped}/{self.total} cells: {self.done} exported, "
                f"{self.skipped} skipped, {self.running} running, {self.failed} failed; "
                f"{elapsed:.0f}s elapsed{estimate}")


def _start_ray(address: Optional[str], workers: Optional[int]):
    try:
        import ray
    except ImportError:
        raise LlmcoreError("llmcore matrix runs its cells on Ray, which is not installed.", stage="matrix",
                           fix="pip install 'llmcore[matrix]' (or pip install ray).") from None
    import logging

    address = address or os.environ.get("RAY_ADDRESS")
    # The workers import llmcore from the same place as this process (a source checkout
    # run as `python -m llmcore` included); on a cluster, every node has it installed.
    here = str(Path(__file__).resolve().parents[1])
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}}
    kwargs = dict(logging_level=logging.ERROR, log_to_driver=False, runtime_env=None if address else env)
    try:
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=workers or os.cpu_count() or 1, include_dashboard=False, **kwargs)
    except Exception as exc:
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise LlmcoreError(f"could not start or reach {where}: {describe(exc)}.", stage="matrix",
                           fix="check --address / RAY_ADDRESS, or run without them for a local Ray.") from None
    return ray


def _tracker_class(ray):
    @ray.remote(num_cpus=0)
    class Tracker:
        """Which cells a worker has started, and how often (a retry starts one again)."""

        def __init__(self):
            self.starts: dict[str, int] = {}
            self.finished: set[str] = set()

        def started(self, output: str) -> None:
            self.starts[output] = self.starts.get(output, 0) + 1

        def finish(self, output: str) -> None:
            self.finished.add(output)

        def attempts(self, output: str) -> int:
            return self.starts.get(output, 0)

        def running(self) -> int:
            return len(set(self.starts) - self.finished)

    return Tracker


def run_matrix(matrix: Matrix, *, address: Optional[str] = None, workers: Optional[int] = None, retries: int = 1,
               perplexity_text: Optional[str] = None, say: Callable[[str], None] = print) -> list[CellResult]:
    """Export every cell that is not complete yet, on Ray; returns one result per cell."""
    from llmcore.plugins import load_registry

    digest = text_digest(perplexity_text)
    planned = plan(matrix, load_registry(), digest)
    progress = Progress(total=len(planned))
    results: dict[str, CellResult] = {}
    todo = []
    for cell, report, problem in planned:
        if report is not None:
            results[cell.name] = CellResult.from_report(cell, "skipped", report)
            progress.skipped += 1
        elif problem:
            results[cell.name] = CellResult.failed(cell, problem)
            progress.failed += 1
            say(f"[llmcore matrix] {cell.name} failed: {problem}")
        else:
            todo.append(cell)
    cells = [cell for cell, _, _ in planned]
    if not todo:
        say(progress.line())
        return [results[c.name] for c in cells]
    say(progress.line())

    from llmcore.progress import interrupts_at_safe_points

    ray = _start_ray(address, workers)
    try:
        with interrupts_at_safe_points():
            _wait_for_cells(ray, todo, results, progress, perplexity_text, digest, retries, say)
    except KeyboardInterrupt:  # cells written so far stay (a rerun resumes from them); the rest are 'interrupted'
        pass
    finally:
        ray.shutdown()
    for cell in cells:
        results.setdefault(cell.name, CellResult.of(cell, "interrupted"))
    return [results[c.name] for c in cells]


def _wait_for_cells(ray, todo: list[Cell], results: dict[str, CellResult], progress: Progress,
                    perplexity_text: Optional[str], digest: Optional[str], retries: int,
                    say: Callable[[str], None]) -> None:
    """Submit every cell to Ray and record each result as it arrives, until all are in or
    Ctrl-C was pressed (the poll raises KeyboardInterrupt: see
    :func:`llmcore.progress.interrupts_at_safe_points`)."""
    from llmcore.progress import stop_if_interrupted

    tracker = _tracker_class(ray).remote()
    remote_export = ray.remote(num_cpus=1)(export_cell)
    pending = {
        # named after the cell: `ps` on a worker shows ray::llmcore-export:MODEL/BACKENDS/RECIPE
        remote_export.options(name=f"{TASK_PREFIX}{cell.name}", memory=cell.memory_bytes,
                              max_retries=retries, retry_exceptions=False)
        .remote(dataclasses.asdict(cell.options), perplexity_text, tracker): cell
        for cell in todo
    }
    last_counts = None
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=2.0)
        for ref in done:
            cell = pending.pop(ref)
            results[cell.name] = _collect(ray, ref, cell, tracker, digest)
            if results[cell.name].status == "ok":
                progress.done += 1
            else:
                progress.failed += 1
                say(f"[llmcore matrix] {cell.name} failed: {results[cell.name].error}")
            tracker.finish.remote(cell.options.output)
        progress.running = ray.get(tracker.running.remote())
        counts = (progress.done, progress.failed, progress.running)
        if counts != last_counts:  # a line when something changed, not every poll
            say(progress.line())
            last_counts = counts
        stop_if_interrupted()


def _collect(ray, ref, cell: Cell, tracker, digest: Optional[str]) -> CellResult:
    attempts = ray.get(tracker.attempts.remote(cell.options.output))
    try:
        result = ray.get(ref)
    except ray.exceptions.RayTaskError as exc:  # export_cell returns its errors: this is a bug in it
        return CellResult.failed(cell, f"[matrix] internal error: {describe(exc.cause or exc, 200)} (report it)",
                                 attempts=attempts)
    except Exception as exc:  # the worker died more often than --retries allows
        return CellResult.failed(cell, f"[matrix] the worker exporting it died ({describe(exc, 160)}). "
                                       "Fix: raise --retries, or give the cell more memory.", attempts=attempts)
    if result["status"] != "ok":
        return CellResult.failed(cell, result["error"], attempts=attempts, wall_s=result.get("wall_s"),
                                 pid=result["pid"], host=result["host"])
    record = {"key": cell.key, "cell": cell.name, "wall_s": result["wall_s"], "peak_rss_mib": result["peak_rss_mib"],
              "perplexity": result.get("perplexity"), "perplexity_text": digest}
    try:
        write_cell(cell, result, record)
    except LlmcoreError as exc:
        return CellResult.failed(cell, exc.one_line(), attempts=attempts)
    return CellResult.from_report(cell, "ok", result["report"], attempts=attempts, pid=result["pid"], host=result["host"],
                                  error=result.get("error"))


# ---- the command -------------------------------------------------------------------------


def format_cells(matrix: Matrix, registry, perplexity_text: Optional[str] = None) -> str:
    """The dry run's table: each cell, what a run would do with it, and where it goes."""
    from tabulate import tabulate

    rows = []
    for cell, report, problem in plan(matrix, registry, text_digest(perplexity_text)):
        o = cell.options
        source = o.checkpoint or f"{o.model} config {o.config}"
        action = "skip (complete)" if report is not None else f"fails: {problem}" if problem else "export"
        rows.append([cell.name, o.model or "(from checkpoint)", source, cell.backends_label, o.quantize or "-",
                     f"{cell.memory_bytes / 2**20:.0f}", o.output, action])
    return tabulate(rows, headers=["cell", "family", "weights", "backends", "quantize", "memory MiB", "output", "run"])


def format_results(results: list[CellResult]) -> str:
    from tabulate import tabulate

    def num(value, fmt):
        return "" if value is None else format(value, fmt)

    rows = [[r.cell, r.status, num(r.wall_s, ".1f"), num(r.peak_rss_mib, ".0f"), num(r.pte_mib, ".2f"),
             num(r.parity_max_abs_diff, ".3g"), num(r.parity_top1, ".0%"), num(r.perplexity, ".3f"),
             r.attempts or "", r.error or ""] for r in results]
    return tabulate(rows, headers=["cell", "status", "wall s", "peak MiB", "pte MiB", "parity max|Δ|", "top-1",
                                   "perplexity", "attempts", "error"])


def add_arguments(p) -> None:
    p.add_argument("file", help="the matrix YAML (models, backends, recipes, output, layout, common)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and exit")
    p.add_argument("--output", help="root folder of the outputs (overrides the file's `output`)")
    p.add_argument("--address", help="an existing Ray cluster (ray://HOST:PORT or auto; default: RAY_ADDRESS, "
                                     "else a local Ray on this machine)")
    p.add_argument("--workers", type=int, metavar="N", help="CPUs of the local Ray (default: all cores)")
    p.add_argument("--retries", type=int, default=1, metavar="N",
                   help="times a cell is retried when its worker dies (default 1)")
    p.add_argument("--perplexity", metavar="TEXT", help="also score each program's perplexity on this text")
    p.add_argument("--summary", metavar="JSON", help=f"where to write the results (default: OUTPUT/{SUMMARY_FILE})")


def cmd_matrix(args) -> int:
    from llmcore.pipeline.write import OutputBundle

    matrix = load_matrix(args.file, root=args.output)
    if args.retries < 0 or (args.workers is not None and args.workers < 1):
        raise LlmcoreError("--retries must be 0 or more and --workers 1 or more.", stage="matrix",
                           fix="pass e.g. --retries 1 --workers 2.")
    if args.perplexity and not Path(args.perplexity).is_file():
        raise LlmcoreError(f"--perplexity {args.perplexity}: no such file.", stage="matrix", fix="pass a UTF-8 text file.")
    if args.dry_run:
        from llmcore.plugins import load_registry

        print(f"{len(matrix.cells)} cells under {matrix.root}:")
        print(format_cells(matrix, load_registry(), args.perplexity))
        return 0
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    results = run_matrix(matrix, address=args.address, workers=args.workers, retries=args.retries,
                         perplexity_text=args.perplexity, say=say)
    print(format_results(results))
    summary = Path(args.summary) if args.summary else matrix.root / SUMMARY_FILE
    summary.parent.mkdir(parents=True, exist_ok=True)
    bundle = OutputBundle()
    try:
        bundle.stage(summary, json.dumps({"cells": [dataclasses.asdict(r) for r in results]}, indent=2) + "\n")
        bundle.commit()
    finally:
        bundle.discard()
    failed = sum(r.status == "failed" for r in results)
    interrupted = sum(r.status == "interrupted" for r in results)
    print(f"summary: {summary}" + (f"; {failed} of {len(results)} cells failed" if failed else ""))
    if interrupted:
        print(f"llmcore matrix: interrupted with {interrupted} cells not exported; the same command resumes.",
              file=sys.stderr)
        return 130
    return 1 if failed else 0
