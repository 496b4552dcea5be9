"""llmcore_runner --etdump FILE: an ETDump of the forward calls that ExecuTorch's Inspector
and `llmcore profile --from-etdump` read."""

from __future__ import annotations

from test_runner import binaries, run_runner  # noqa: F401  (the fixture builds the runner)


def test_runner_etdump_is_read_by_inspector_and_llmcore_profile(binaries, exports, cli, tmp_path):  # noqa: F811
    pte = exports("xnnpack").pte  # tiny nanoGPT, XNNPACK, KV cache (llmcore's llama:: kernels)
    etdump = tmp_path / "run.etdp"
    _, out, err = run_runner(pte, "Hello there", "--max-new-tokens", 6, "--temperature", 0, "--print-ids",
                             "--etdump", etdump)
    assert etdump.is_file() and etdump.stat().st_size > 0
    assert not etdump.with_name(etdump.name + ".partial").exists()

    from executorch.devtools import Inspector

    inspector = Inspector(etdump_path=str(etdump))
    names = {e.name for block in inspector.event_blocks for e in block.events}
    assert "Method::execute" in names
    assert "llama::custom_sdpa.out" in names  # the runner's own kernel, timed by the runtime

    result = cli("profile", str(pte), "--from-etdump", str(etdump))
    assert result.returncode == 0, result.stderr
    assert "Fully Connected" in result.stdout and "XnnpackBackend" in result.stdout, result.stdout
    assert "Method::execute" in result.stdout, result.stdout


def test_runner_etdump_errors(binaries, exports, tmp_path):  # noqa: F811
    pte = exports("xnnpack").pte
    code, _, err = run_runner(pte, "Hi", "--etdump", tmp_path / "missing" / "x.etdp", check=False)
    assert code == 1 and "--etdump" in err and "does not exist" in err
    code, _, err = run_runner(pte, "Hi", "--etdump", check=False)
    assert code == 2
