"""How far each model family's llmcore model is from transformers' own: max |logit difference|,
eager fp32, last position after prefills of 1, 17 and 64 tokens, for each family and
checkpoint form (a Hugging Face folder saved by transformers, and a GGUF written from it as
llama.cpp's converter writes that architecture), on the tiny random checkpoints the
plugins' tests make (their helpers are reused, so this measures what the tests check).
The tests assert <= 1e-4; this prints the figures.

    .venv/bin/python benchmarks/family_parity.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "plugins" / name / "tests") for name in ("phi", "gemma", "qwen", "mistral")]


def main() -> None:
    import llmcore_gemma
    import llmcore_phi
    import llmcore_qwen
    import qwen_testutils
    import test_gemma
    import test_mistral
    import test_phi
    from llmcore_llama.testing import MAX_POS, check_eager_against, reference

    from llmcore.records import LoadOptions

    tmp = Path(tempfile.mkdtemp())
    rows = []

    def measure(family: str, form: str, module, folder: Path) -> None:
        rows.append((family, form, check_eager_against(module, reference(folder), 1e-4)))

    for family in ("qwen2", "qwen3"):
        folder = qwen_testutils.hf_checkpoint(tmp / family, family, tokenizer=False)
        measure(family, "HF", llmcore_qwen.load_hf(folder, LoadOptions()).module, folder)
        qwen_testutils.write_gguf(folder, tmp / f"{family}.gguf")
        measure(family, "GGUF", llmcore_qwen.load_gguf(tmp / f"{family}.gguf", LoadOptions()).module, folder)
    for family, config in (("phi3", dict(sliding_window=8)), ("phi4-mini", {})):
        folder = test_phi.phi_checkpoint(tmp / family, family, tokenizer=False, **config)
        measure(family, "HF", test_phi.load(folder).module, folder)
        test_phi.phi_gguf(folder, tmp / f"{family}.gguf")
        loaded = llmcore_phi.load_gguf(tmp / f"{family}.gguf", LoadOptions(max_seq_len=MAX_POS))
        measure(family, "GGUF", loaded.module, folder)
    for family in ("gemma", "gemma2", "gemma3"):
        folder = test_gemma.checkpoint(tmp / family, family, tokenizer=False)
        measure(family, "HF", test_gemma.load(folder).module, folder)
        # llama.cpp scales attention by head_dim ** -0.5 below the 27B sizes: no other scalar
        scalar = {} if family == "gemma" else dict(query_pre_attn_scalar=24)
        folder = test_gemma.checkpoint(tmp / f"{family}-gguf", family, tokenizer=False, **scalar)
        test_gemma.gemma_gguf(folder, tmp / f"{family}.gguf")
        measure(family, "GGUF", llmcore_gemma.load_gguf(tmp / f"{family}.gguf", LoadOptions()).module, folder)
    folder = test_mistral.mistral_checkpoint(tmp / "mistral", tokenizer=False)
    measure("mistral", "HF", test_mistral.load(folder).module, folder)

    print("| family | checkpoint | max abs logit difference vs transformers |")
    print("|---|---|---:|")
    for family, form, diff in rows:
        print(f"| {family} | {form} | {diff:.1e} |")


if __name__ == "__main__":
    main()
