"""Plugin discovery: stevedore finds and imports plugins, pluggy registers them.

Plugins are published under the entry-point group ``llmcore``. Loading is forgiving: a
plugin that fails to import, or whose hook raises or returns the wrong thing, is recorded
as a :class:`PluginFailure` and skipped, so one broken package never takes down
``llmcore plugins`` or an export that does not need it.

``LLMCORE_LOAD_PLUGINS=a,b`` restricts loading to the named entry points (an empty value
loads none); tests use it to keep installed plugins out of the way.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Generic, Iterable, Optional, TypeVar

import pluggy

from llmcore import hookspecs
from llmcore.errors import LlmcoreError, PluginConflictError, choose_one_of
from llmcore.records import Backend, Command, ModelFamily, PostPass, QuantizerRecipe, RuntimeLibrary, SourceTransform

ENTRY_POINT_GROUP = "llmcore"
ALLOWLIST_ENV = "LLMCORE_LOAD_PLUGINS"
# Plugins that ship inside the core package and always load: name -> module. The commands
# too: the core's own (export, plugins, run) and the applications' (llmcore.apps).
BUILTIN_PLUGINS = {
    "kv-cache": "llmcore.builtins.kv_cache",
    "executorch-kernels": "llmcore.builtins.executorch_kernels",
    "runtime-attention": "llmcore.builtins.runtime_attention",
    "core-commands": "llmcore.builtins.commands",
    "apps": "llmcore.apps",
}

# kind -> (hook name, record type, what the CLI calls one, and several)
KINDS: dict[str, tuple[str, type, str, str]] = {
    "model_families": ("llmcore_model_families", ModelFamily, "model family", "model families"),
    "transforms": ("llmcore_source_transforms", SourceTransform, "source transform", "source transforms"),
    "quantizers": ("llmcore_quantizers", QuantizerRecipe, "quantizer recipe", "quantizer recipes"),
    "backends": ("llmcore_partitioners", Backend, "backend", "backends"),
    "post_passes": ("llmcore_post_passes", PostPass, "post-pass", "post-passes"),
    "runtime_libraries": ("llmcore_runtime_libraries", RuntimeLibrary, "runtime library", "runtime libraries"),
    "commands": ("llmcore_commands", Command, "command", "commands"),
}

R = TypeVar("R")


@dataclass
class PluginInfo:
    """One loaded plugin, as ``llmcore plugins`` shows it."""

    name: str
    entry_point: str
    distribution: Optional[str] = None
    version: Optional[str] = None
    hooks: list[str] = field(default_factory=list)
    provides: dict[str, list[str]] = field(default_factory=dict)

    @property
    def package(self) -> str:
        """How error messages name the plugin: its distribution, else its entry point."""
        if self.distribution:
            return f"{self.distribution} {self.version or ''}".strip()
        return self.entry_point


@dataclass
class PluginFailure:
    """A plugin that could not be used, and why."""

    name: str
    entry_point: str
    error: str
    detail: str = ""


@dataclass
class Provided(Generic[R]):
    """A record together with the plugin that provided it."""

    record: R
    plugin: PluginInfo


@dataclass
class Conflict:
    kind: str
    name: str
    plugins: list[PluginInfo]

    def error(self) -> PluginConflictError:
        noun = KINDS[self.kind][2]
        who = " and ".join(p.package for p in self.plugins)
        return PluginConflictError(
            f"{noun} {self.name!r} is provided by more than one plugin: {who}.",
            stage="plugins",
            plugin=self.plugins[0].name,
            fix="uninstall one of them, or pick one with LLMCORE_LOAD_PLUGINS.",
        )


class Registry:
    """Everything the loaded plugins provide, indexed by kind and name."""

    def __init__(self) -> None:
        self.plugins: list[PluginInfo] = []
        self.failures: list[PluginFailure] = []
        self.conflicts: list[Conflict] = []
        self._items: dict[str, dict[str, Provided]] = {kind: {} for kind in KINDS}
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)

    # ---- building -------------------------------------------------------------------

    def add_plugin(self, plugin: Any, info: PluginInfo) -> None:
        """Register one imported plugin object and collect its records."""
        try:
            self.manager.register(plugin, name=info.name)
        except Exception as exc:  # pluggy validates hook signatures here
            self.failures.append(PluginFailure(info.name, info.entry_point, _short(exc)))
            return
        try:
            self.manager.check_pending()  # an implementation of a hook no hookspec declares: a typo
        except pluggy.PluginValidationError:
            self._fail(info, _unknown_hooks(self.manager, info.name))
            return
        collected: dict[str, list] = {}
        for kind, (hook_name, record_type, _, _) in KINDS.items():
            caller = getattr(self.manager.hook, hook_name)
            impls = [i for i in caller.get_hookimpls() if i.plugin_name == info.name]
            for impl in impls:
                info.hooks.append(hook_name)
                try:
                    records = list(impl.function() or [])
                except LlmcoreError as exc:  # a record refused its fields (an invalid name, say)
                    exc.stage, exc.plugin = exc.stage or "plugins", exc.plugin or info.name
                    self._fail(info, f"hook {hook_name}: {exc.one_line()}", exc)
                    return
                except Exception as exc:
                    self._fail(info, f"hook {hook_name} raised {_short(exc)}", exc)
                    return
                bad = [r for r in records if not isinstance(r, record_type)]
                if bad:
                    self._fail(
                        info,
                        f"hook {hook_name} returned {type(bad[0]).__name__}, "
                        f"expected llmcore.records.{record_type.__name__}",
                    )
                    return
                collected.setdefault(kind, []).extend(records)
        for kind, records in collected.items():
            for record in records:
                self._add(kind, record, info)
            info.provides[kind] = [r.name for r in records]
        self.plugins.append(info)

    def _fail(self, info: PluginInfo, message: str, exc: Optional[BaseException] = None) -> None:
        self.manager.unregister(name=info.name)
        detail = "".join(traceback.format_exception(exc)) if exc else ""
        self.failures.append(PluginFailure(info.name, info.entry_point, message, detail))

    def _add(self, kind: str, record: Any, info: PluginInfo) -> None:
        existing = self._items[kind].get(record.name)
        if existing is None:
            self._items[kind][record.name] = Provided(record, info)
            return
        for conflict in self.conflicts:
            if conflict.kind == kind and conflict.name == record.name:
                conflict.plugins.append(info)
                return
        self.conflicts.append(Conflict(kind, record.name, [existing.plugin, info]))

    # ---- lookups --------------------------------------------------------------------

    def names(self, kind: str) -> list[str]:
        return sorted(self._items[kind])

    def all(self, kind: str, *, by_name: bool = True) -> list[Provided]:
        """Every record of a kind, by name; or in the order the plugins were registered (the
        built-in ones first), as ``llmcore --help`` lists the commands."""
        if not by_name:
            return list(self._items[kind].values())
        return [self._items[kind][name] for name in sorted(self._items[kind])]

    def get(self, kind: str, name: str, *, stage: str) -> Provided:
        """The record of this kind and name, or an error that says what exists."""
        for conflict in self.conflicts:
            if conflict.kind == kind and conflict.name == name:
                raise conflict.error()
        if name not in self._items[kind]:
            noun = KINDS[kind][2]
            for failure in self.failures:
                if failure.name == name:  # the plugin named like the thing asked for did not load
                    raise LlmcoreError(
                        f"{noun} {name!r} is unavailable: plugin {name!r} could not be used ({failure.error}).",
                        stage=stage,
                        plugin=name,
                        fix="install what it needs (or reinstall it), then check `llmcore plugins`; "
                        "or choose one of: " + (", ".join(sorted(self._items[kind])) or "(none installed)") + ".",
                    )
            hint = ""
            failed = [f.name for f in self.failures]
            if failed:
                hint = f"These plugins failed to load: {', '.join(failed)} (see `llmcore plugins`)."
            else:
                hint = "Install the plugin that provides it (see `llmcore plugins`)."
            raise choose_one_of(noun, name, self._items[kind], stage=stage, fix_hint=hint)
        return self._items[kind][name]


def _unknown_hooks(manager: pluggy.PluginManager, plugin_name: str) -> str:
    """Name the hook implementations of ``plugin_name`` that no hookspec declares."""
    import difflib

    known = [hook for hook, *_ in KINDS.values()]
    unknown = sorted(
        name
        for name, caller in vars(manager.hook).items()
        if isinstance(caller, pluggy.HookCaller) and not caller.has_spec()
        and any(i.plugin_name == plugin_name and not i.optionalhook for i in caller.get_hookimpls())
    )
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    which = "which are not llmcore hooks" if len(parts) > 1 else "which is not an llmcore hook"
    return f"implements {', '.join(parts) or 'a hook'}, {which} (the hooks are: {', '.join(known)})"


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _add_builtins(registry: Registry) -> None:
    import importlib

    from llmcore import __version__

    for name, module in BUILTIN_PLUGINS.items():
        info = PluginInfo(name=name, entry_point=module, distribution="llmcore", version=__version__)
        registry.add_plugin(importlib.import_module(module), info)


def _entry_point_owners() -> dict[tuple[str, str], tuple[str, str]]:
    """(entry-point name, value) -> (distribution, version), for the ``llmcore`` group."""
    from importlib.metadata import distributions

    owners = {}
    for dist in distributions():
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP:
                owners.setdefault((ep.name, ep.value), (dist.metadata["Name"], dist.version))
    return owners


def _allowlist() -> Optional[list[str]]:
    value = os.environ.get(ALLOWLIST_ENV)
    if value is None:
        return None
    return [n.strip() for n in value.split(",") if n.strip()]


def load_registry(extra_plugins: Iterable[tuple[str, Any]] = ()) -> Registry:
    """Discover installed plugins (and any given directly) and build a :class:`Registry`.

    ``extra_plugins`` are ``(name, object)`` pairs registered as if they had been found
    through an entry point; tests use it for throwaway plugins.
    """
    from stevedore import ExtensionManager, NamedExtensionManager

    registry = Registry()
    load_errors: list[PluginFailure] = []
    _add_builtins(registry)

    def on_load_failure(_manager, entry_point, exc) -> None:
        load_errors.append(
            PluginFailure(
                entry_point.name,
                entry_point.value,
                f"failed to import: {_short(exc)}",
                "".join(traceback.format_exception(exc)),
            )
        )

    def on_missing(names) -> None:
        for name in sorted(names):
            load_errors.append(
                PluginFailure(name, "", f"{ALLOWLIST_ENV} names {name!r}, which is not installed")
            )

    allow = _allowlist()
    if allow is None:
        manager = ExtensionManager(
            ENTRY_POINT_GROUP, invoke_on_load=False, on_load_failure_callback=on_load_failure
        )
    else:
        manager = NamedExtensionManager(
            ENTRY_POINT_GROUP,
            names=allow,
            invoke_on_load=False,
            name_order=True,
            on_load_failure_callback=on_load_failure,
            on_missing_entrypoints_callback=on_missing,
        )
    owners = _entry_point_owners()
    for ext in manager.extensions:
        dist_name, version = owners.get((ext.name, ext.entry_point.value), (None, None))
        info = PluginInfo(
            name=ext.name, entry_point=ext.entry_point.value, distribution=dist_name, version=version
        )
        registry.add_plugin(ext.plugin, info)
    for name, plugin in extra_plugins:
        registry.add_plugin(plugin, PluginInfo(name=name, entry_point=repr(plugin)))
    registry.failures[:0] = load_errors
    return registry
