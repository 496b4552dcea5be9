"""Every ``llmcore`` command comes through the ``llmcore_commands`` hook: llmcore's own, and
a third-party plugin's the same way. Two plugins claiming one name make that command an
error naming both; a command whose extra is missing fails in one line naming the extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmcore import errors
from llmcore.errors import LlmcoreError, require_extra
from llmcore.plugins import load_registry

from fakeplugins import install_fake_distribution

COMMAND_PLUGIN = """
from llmcore import hookimpl
from llmcore.records import Command


def add_arguments(parser):
    parser.add_argument("who")
    parser.add_argument("--shout", action="store_true")


def hello(args):
    text = f"hello, {{args.who}} (DIST)"
    print(text.upper() if args.shout else text)
    return 0


@hookimpl
def llmcore_commands():
    return [Command(name={name!r}, help="say hello", add_arguments=add_arguments, run=hello, **{extra})]
"""


def _site(tmp_path, *plugins: tuple[str, str, dict]) -> dict:
    """Installs ``(distribution, command name, Command keywords)`` plugins into a folder on
    the path; returns the environment a ``llmcore`` subprocess sees them in."""
    site = tmp_path / "site"
    for dist, name, extra in plugins:
        module = dist.replace("-", "_")
        source = COMMAND_PLUGIN.format(name=name, extra=extra).replace("DIST", dist)
        install_fake_distribution(site, dist, module.removeprefix("llmcore_"), module, source)
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def test_llmcores_own_commands_are_registered_through_the_hook(monkeypatch):
    monkeypatch.setenv("LLMCORE_LOAD_PLUGINS", "")
    registry = load_registry()
    providers = {p.record.name: p.plugin.name for p in registry.all("commands")}
    assert providers == {
        "export": "core-commands", "plugins": "core-commands", "run": "core-commands",
        "inspect": "apps", "profile": "apps", "eval": "apps", "matrix": "apps", "serve": "apps", "chat": "apps",
    }
    serve = registry.get("commands", "serve", stage="test").record
    assert (serve.extra, serve.runs_program) == ("serve", True) and "starlette" in serve.needs
    assert registry.get("commands", "matrix", stage="test").record.needs == ("ray",)


def test_a_plugin_adds_a_command(tmp_path, cli):
    env = _site(tmp_path, ("llmcore-hello", "hello", {}))
    result = cli("hello", "world", "--shout", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "HELLO, WORLD (LLMCORE-HELLO)\n"
    assert "say hello" in cli("--help", env=env).stdout
    plugins = {p["name"]: p for p in json.loads(cli("plugins", "--json", env=env).stdout)["plugins"]}
    assert plugins["hello"]["provides"] == {"commands": ["hello"]}
    assert cli("hello", env=env).returncode == 2  # its own arguments: argparse's usage error


def test_two_plugins_claiming_one_command_is_one_error_naming_both(tmp_path, cli):
    env = _site(tmp_path, ("llmcore-hello", "hello", {}), ("llmcore-greet", "hello", {}))
    result = cli("hello", "world", "--shout", env=env)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("llmcore: error: [plugins/") and "command 'hello' is provided by more than one plugin" in line
    assert "llmcore-hello 0.0.1" in line and "llmcore-greet 0.0.1" in line
    assert cli("plugins", env=env).returncode == 0  # the other commands are not affected


def test_a_plugin_claiming_a_command_of_llmcores_names_both(tmp_path, cli):
    env = _site(tmp_path, ("llmcore-impostor", "export", {}))
    result = cli("export", "--model", "nanogpt", env=env)
    assert result.returncode == 2
    assert "command 'export' is provided by more than one plugin: llmcore 0.1.0 and llmcore-impostor" in result.stderr


def test_a_plugin_command_whose_extra_is_missing_names_its_distributions_extra(tmp_path, cli):
    env = _site(tmp_path, ("llmcore-needy", "needy", {"extra": "gui", "needs": ("no_such_module_for_llmcore",)}))
    result = cli("needy", "world", env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "llmcore: error: [needy] llmcore needy needs the 'gui' extra: pip install 'llmcore-needy[gui]' "
        "(missing: no_such_module_for_llmcore)"]
    assert "usage: llmcore needy" in cli("needy", "--help", env=env).stdout  # help needs no extra


MISSING = """
import sys
from llmcore import errors
errors.module_installed = lambda name: name not in {missing!r}
from llmcore.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(
    "argv, missing, line",
    [
        (["serve", "x.pte"], {"starlette", "uvicorn"},
         "llmcore: error: [serve] llmcore serve needs the 'serve' extra: pip install 'llmcore[serve]' "
         "(missing: starlette, uvicorn)"),
        (["matrix", "m.yaml"], {"ray"},
         "llmcore: error: [matrix] llmcore matrix needs the 'matrix' extra: pip install 'llmcore[matrix]' "
         "(missing: ray)"),
    ],
)
def test_a_command_whose_extra_is_missing_fails_in_one_line_naming_it(argv, missing, line):
    """The import check made to miss the extra's modules: the command stops before it loads anything."""
    done = subprocess.run([sys.executable, "-c", MISSING.format(missing=missing, argv=argv)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [line]


def test_run_json_schema_without_the_grammar_engine_names_the_constrain_extra(monkeypatch):
    monkeypatch.setattr(errors, "module_installed", lambda name: name != "llguidance")
    with pytest.raises(LlmcoreError) as caught:
        require_extra("llmcore run --json-schema", "constrain", ("llguidance",), stage="run")
    assert caught.value.one_line() == (
        "[run] llmcore run --json-schema needs the 'constrain' extra: pip install 'llmcore[constrain]' "
        "(missing: llguidance)")
    monkeypatch.undo()
    require_extra("llmcore run --json-schema", "constrain", ("llguidance",), stage="run")  # installed here
