"""Starting ``llmcore serve`` for tests: a copy of a program with a chat template of the
test's choosing (or the one its export saved), served as a subprocess on a free loopback
port."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence

import pytest


@contextmanager
def serve_program(source_pte: Path, folder: Path, template: Optional[str], name: str = "tiny",
                  args: Sequence[str] = ()):
    """Yields (base URL, served .pte path); the server is stopped on exit. ``template`` None
    keeps the ``tokenizer_config.json`` the export wrote; ``args`` go to ``llmcore serve``."""
    pte = folder / f"{name}.pte"
    shutil.copy(source_pte, pte)
    shutil.copy(source_pte.with_name("tokenizer.json"), folder / "tokenizer.json")
    if template is None:
        shutil.copy(source_pte.with_name("tokenizer_config.json"), folder / "tokenizer_config.json")
    else:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "llmcore", "serve", str(pte), "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if json.loads(r.read())["status"] == "ok":
                    break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"llmcore serve did not start:\n{proc.stdout.read()}")
            time.sleep(0.3)
    try:
        yield base, pte
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def reference(pte: Path, prompt_text: str, max_tokens: int) -> str:
    """Greedy text of a freshly loaded program (what ``llmcore run`` generates)."""
    from llmcore.runtime.generate import Sampling, TextTokenizer, generate, prompt_ids_for
    from llmcore.runtime import Program

    program = Program.load(pte)
    tokenizer = TextTokenizer.from_file(pte.with_name("tokenizer.json"))
    out = generate(program, prompt_ids_for(program, tokenizer, prompt_text), max_tokens, Sampling())
    return tokenizer.decode(out.generated_ids, skip_special_tokens=True)
