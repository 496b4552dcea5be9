"""The CLI as a user runs it: export, plugins, run; and the errors users meet first."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from clitools import read_json

TINY = ["export", "--model", "nanogpt", "--config", "tiny"]


@pytest.fixture(scope="module")
def int8_export(tmp_path_factory):
    from clitools import run_cli

    out = tmp_path_factory.mktemp("cli") / "tiny8.pte"
    result = run_cli(*TINY, "--plugins", "xnnpack", "--quantize", "int8-dynamic", "-o", str(out))
    assert result.returncode == 0, result.stderr
    return out, result


def test_export_writes_pte_report_and_tokenizer(int8_export):
    out, result = int8_export
    assert out.is_file()
    report = read_json(out.with_name("tiny8.report.json"))
    assert (out.parent / "tokenizer.json").is_file()
    assert report["delegation"]["delegated_nodes"] > 0
    assert "Number of delegated nodes" in result.stdout  # the summary is printed
    assert "op_type" in result.stdout  # and the per-operator table
    assert "parity" in result.stdout
    assert "[llmcore] lower" in result.stderr  # progress on stderr


def test_run_streams_text_and_prints_stats(int8_export, cli):
    out, _ = int8_export
    result = cli("run", str(out), "--prompt", "Hello", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert "decode" in result.stdout and "tok/s" in result.stdout and "time to first token" in result.stdout


def test_run_json_is_deterministic_when_greedy(int8_export, cli):
    out, _ = int8_export
    runs = [cli("run", str(out), "--prompt", "Hi there", "--max-new-tokens", "6", "--json") for _ in range(2)]
    data = [json.loads(r.stdout) for r in runs]
    assert data[0]["generated_ids"] == data[1]["generated_ids"]
    assert len(data[0]["generated_ids"]) == 6
    assert data[0]["prompt_ids"] == list("Hi there".encode())  # byte-level tokenizer
    assert data[0]["stats"]["decode_tok_s"] > 0


def test_sampling_with_a_seed_repeats(int8_export, cli):
    out, _ = int8_export
    args = ["run", str(out), "--prompt", "Hi", "--max-new-tokens", "10", "--temperature", "1.0",
            "--top-k", "50", "--top-p", "0.9", "--seed", "7", "--json"]
    a, b = (json.loads(cli(*args).stdout)["generated_ids"] for _ in range(2))
    assert a == b


def test_plugins_json_lists_versions_and_hooks(cli):
    result = cli("plugins", "--json")
    assert result.returncode == 0
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert plugins["nanogpt"]["distribution"] == "llmcore-nanogpt" and plugins["nanogpt"]["version"]
    assert "int8-dynamic" in plugins["xnnpack"]["provides"]["quantizers"]
    assert "llmcore_post_passes" in plugins["xnnpack"]["hooks"]


def test_recipe_file_with_flags_overriding(cli, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: nanogpt\nconfig: tiny\nplugins: [xnnpack]\nmax-seq-len: 64\n")
    out = tmp_path / "r.pte"
    result = cli("export", "--recipe", str(recipe), "--max-seq-len", "32", "--quiet", "-o", str(out))
    assert result.returncode == 0, result.stderr
    report = read_json(tmp_path / "r.report.json")
    assert report["model"]["max_seq_len"] == 32
    assert report["backends"][0]["name"] == "xnnpack"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("model: nanogpt\nbogus_key: 1\n", "unknown key 'bogus_key'"),
        ("model: nanogpt\nmax-seq-len: lots\n", "'max_seq_len' must be an integer"),
        ("model: [unclosed\n", "not valid YAML at line"),
        ("- just\n- a list\n", "must be a YAML mapping"),
    ],
)
def test_recipe_errors_name_the_key(cli, tmp_path, text, expected):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    result = cli("export", "--recipe", str(recipe), "-o", str(tmp_path / "x.pte"))
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--plugins", "nosuch"], "unknown backend 'nosuch'"),
        (["--plugins", "xnnpack", "--quantize", "nosuch"], "unknown quantizer recipe 'nosuch'"),
        (["--plugins", "none", "--quantize", "int8-dynamic"], "meant for xnnpack"),
        (["--plugins", "xnnpack", "--backend-option", "xnnpack.bogus=1"], "has no option 'bogus'"),
        (["--max-seq-len", "4096"], "beyond what the model supports"),
        (["--plugins", "nanogpt"], "is a model family, not a backend"),
    ],
)
def test_bad_flags_fail_fast_with_one_line(cli, tmp_path, args, expected):
    out = tmp_path / "x.pte"
    result = cli(*TINY, *args, "-o", str(out))
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Fix:" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def test_unknown_model_family(cli, tmp_path):
    result = cli("export", "--model", "nosuch", "-o", str(tmp_path / "x.pte"))
    assert result.returncode == 2
    assert "unknown model family 'nosuch'" in result.stderr and "nanogpt" in result.stderr


def test_failed_export_leaves_no_pte(cli, tmp_path):
    # A parity tolerance of zero fails after the program is built, just before writing: 8da8w's
    # XNNPACK program is a few thousandths of a logit from its eager model (0.00246 on the Xeon;
    # int8-dynamic's is now exact, since nanoGPT's GELU is the tanh form XNNPACK computes)
    out = tmp_path / "strict.pte"
    result = cli(*TINY, "--plugins", "xnnpack", "--quantize", "8da8w", "--strict-parity", "0", "-o", str(out))
    assert result.returncode == 2
    assert "parity check failed" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no .pte, no report, no temporary files


def test_debug_shows_the_traceback(cli, tmp_path):
    result = cli("--debug", *TINY, "--max-seq-len", "100000", "-o", str(tmp_path / "x.pte"))
    assert result.returncode == 2
    assert "Traceback" in result.stderr


class _Exploit:
    """Unpickling this calls os.system: the payload a malicious checkpoint carries."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_small_program_runs_on_one_thread_unless_told_otherwise(int8_export, cli, tmp_path):
    """Without ``--threads`` a program under 16 MiB runs on one runtime thread (its
    operators are too small for a second to pay: docs/performance.md), in ``llmcore run``
    as in ``llmcore_runner``; a larger one keeps the runtime's one thread per core."""
    from llmcore.runtime import ONE_THREAD_BELOW_BYTES, default_threads

    out, _ = int8_export
    assert out.stat().st_size < ONE_THREAD_BELOW_BYTES and default_threads(out) == 1
    run = json.loads(cli("run", str(out), "--prompt", "Hi there", "--max-new-tokens", "2", "--json").stdout)
    assert run["runtime_threads"] == 1
    large = tmp_path / "large.pte"
    with open(large, "wb") as f:
        f.truncate(ONE_THREAD_BELOW_BYTES)  # sparse: the size is what counts
    assert default_threads(large) is None
    assert default_threads(tmp_path / "missing.pte") is None  # loading it reports the error


def test_malicious_pickle_checkpoint_is_refused_and_never_runs(cli, tmp_path):
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt.pt"
    with open(ckpt, "wb") as f:
        pickle.dump({"model_args": {}, "model": _Exploit(marker)}, f)
    result = cli("export", "--model", "nanogpt", "--checkpoint", str(ckpt), "-o", str(tmp_path / "x.pte"))
    assert result.returncode == 2
    assert "refused to load" in result.stderr
    assert not marker.exists()
    assert not (tmp_path / "x.pte").exists()


def test_output_folder_that_does_not_exist(cli, tmp_path):
    result = cli(*TINY, "-o", str(tmp_path / "no" / "such" / "x.pte"))
    assert result.returncode == 2 and "does not exist" in result.stderr
    assert not (tmp_path / "no").exists()


def test_threads_sets_the_runtime_pool_and_changes_no_token(int8_export, cli):
    """``--threads N`` (every command that runs a program) sizes ExecuTorch's thread pool:
    greedy tokens are the same on one thread or two; 0 is refused in one line."""
    from executorch.extension.pybindings import portable_lib

    from llmcore.runtime import use_threads

    out, _ = int8_export
    args = ["run", str(out), "--prompt", "Hi there", "--max-new-tokens", "6", "--json"]
    one, two = (json.loads(cli(*args, "--threads", n).stdout) for n in ("1", "2"))
    assert (one["runtime_threads"], two["runtime_threads"]) == (1, 2)
    assert one["generated_ids"] == two["generated_ids"]
    refused = cli(*args, "--threads", "0")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "llmcore: error: [run] --threads 0 is not a thread count. Fix: pass --threads 1 or more."]
    for command in ("chat", "serve", "eval", "profile"):
        assert "--threads" in cli(command, "--help").stdout

    before = portable_lib._threadpool_get_thread_count()
    try:
        use_threads(1)
        assert portable_lib._threadpool_get_thread_count() == 1
    finally:
        use_threads(before)
    assert portable_lib._threadpool_get_thread_count() == before
