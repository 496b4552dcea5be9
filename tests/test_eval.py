"""llmcore eval: perplexity of a program and of its eager model, on the shipped text."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from clitools import ROOT

from llmcore.errors import LlmcoreError
from llmcore.apps.evaluate import score_llama_perplexity

TEXT = ROOT / "benchmarks" / "data" / "alice-chapter1.txt"


def test_eval_prints_both_perplexities_fp32_agrees(exports, cli):
    pte = exports("xnnpack").pte
    result = cli("eval", str(pte), "--text", str(TEXT), "--max-tokens", "80", "--window", "32", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    program, eager = data["program"], data["eager"]
    assert program["tokens_scored"] == eager["tokens_scored"] == 79
    # Random weights over a 257-token vocabulary: perplexity near the vocabulary size.
    assert 100 < eager["perplexity"] < 600
    assert abs(data["delta_pct"]) < 0.01  # fp32 program: the same model
    assert data["divergence"]["mean_kl"] < 1e-6 and data["divergence"]["top1_agreement"] == 1.0
    assert data["delta_pct_stderr"] < 0.01 and data["divergence"]["mean_kl_stderr"] < 1e-6


def test_eval_of_int8_program_shows_a_small_cost(exports, cli):
    pte = exports("int8").pte
    result = cli("eval", str(pte), "--text", str(TEXT), "--max-tokens", "48", "--json")
    data = json.loads(result.stdout)
    assert math.isfinite(data["delta"]) and abs(data["delta_pct"]) < 2.0


def test_eval_text_output(exports, cli):
    result = cli("eval", str(exports("xnnpack").pte), "--text", str(TEXT), "--max-tokens", "20", "--no-eager")
    assert result.returncode == 0 and "program  perplexity" in result.stdout


def test_eval_refuses_a_program_without_cache(exports, cli):
    result = cli("eval", str(exports("nocache").pte), "--text", str(TEXT))
    assert result.returncode == 2 and "has none" in result.stderr


def test_eval_refuses_an_eager_reference_larger_than_memory(exports, cli, tmp_path):
    """An 8B's eager reference is 30 GiB of fp32: refused in one line before it is loaded (the
    kernel would kill the process without one), with the way to score the program alone."""
    import shutil

    pte = exports("xnnpack").pte
    report = json.loads(pte.with_name(pte.stem + ".report.json").read_text())
    assert report["model"]["parameters"] > 0
    for file in pte.parent.iterdir():
        shutil.copy(file, tmp_path / file.name)
    report["model"]["parameters"] = 10**13  # 37 TiB of fp32: more than any machine running this
    (tmp_path / (pte.stem + ".report.json")).write_text(json.dumps(report))
    result = cli("eval", str(tmp_path / pte.name), "--text", str(TEXT), "--max-tokens", "20")
    assert result.returncode == 2 and "10000.00B parameters" in result.stderr and "--no-eager" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = cli("eval", str(tmp_path / pte.name), "--text", str(TEXT), "--max-tokens", "20", "--no-eager")
    assert result.returncode == 0, result.stderr


# A fake model small enough to score by hand: the logits at a position depend on the token
# there, on the position, and on the sum of every token up to it (a stand-in for attention
# over the KV cache), through fixed random tables.
VOCAB, BOS = 11, 0
_gen = torch.Generator().manual_seed(0)
TOKEN_TABLE, POS_TABLE, SUM_TABLE = (torch.randn(n, VOCAB, generator=_gen) for n in (VOCAB, 64, VOCAB))


def fake_logits(prefix: list[int]) -> torch.Tensor:
    """The full-sequence logits at the last position of ``prefix``."""
    return TOKEN_TABLE[prefix[-1]] + POS_TABLE[len(prefix) - 1] + SUM_TABLE[sum(prefix) % VOCAB]


def fake_kv_model(calls: list | None = None):
    """``logits_fn(tokens, pos)`` over a KV cache, as Program.logits: the logits of the last
    of ``tokens``, written from ``pos``; ``calls`` collects the number of tokens of each call."""
    cache: list[int] = []

    def logits_fn(tokens: list[int], pos: int) -> torch.Tensor:
        assert tokens and pos <= len(cache)  # positions before pos must be written
        del cache[pos:]
        cache.extend(tokens)
        if calls is not None:
            calls.append(len(tokens))
        return fake_logits(cache)

    return logits_fn


def test_sliding_scores_every_token_once_with_its_windows_context():
    """Windows of 8 overlapping by 4: each token after the first scored once, with the
    logits of the full window prefix before it; each window's context in one prefill call."""
    from llmcore.apps.evaluate import score

    ids = [(5 * i + 2) % VOCAB for i in range(21)]
    nlls, scored_until = [], 0
    for begin in range(0, len(ids), 4):
        end = min(begin + 8, len(ids))
        for pos in range(end - begin - 1):
            target = begin + pos + 1
            if target > scored_until:
                nlls.append(-torch.log_softmax(fake_logits(ids[begin:begin + pos + 1]), dim=-1)[ids[target]].item())
        scored_until = end - 1
        if scored_until >= len(ids) - 1:
            break
    calls: list[int] = []
    result = score(fake_kv_model(calls), ids, 8)
    assert result.tokens_scored == len(nlls) == len(ids) - 1
    assert result.perplexity == pytest.approx(math.exp(sum(nlls) / len(nlls)), rel=1e-6)
    assert max(calls) > 1 and len(calls) < len(ids) + 3 * 4  # context prefilled, not fed token by token


def test_llama_perplexity_scores_second_halves_of_chunks_as_llama_cpp():
    ctx = 8
    ids = [BOS] + [(7 * i + 3) % VOCAB for i in range(2 * ctx + 4)]  # 2 chunks, 5 tokens left over
    # By hand: chunk c is ids[8c:8c+8] with BOS first; positions 4, 5, 6 score the next token.
    nlls = []
    for c in range(2):
        chunk = [BOS] + ids[c * ctx + 1:(c + 1) * ctx]
        for j in range(ctx // 2, ctx - 1):
            nlls.append(-torch.log_softmax(fake_logits(chunk[:j + 1]), dim=-1)[chunk[j + 1]].item())
    expected = math.exp(sum(nlls) / len(nlls))

    calls: list[int] = []
    result = score_llama_perplexity(fake_kv_model(calls), ids, ctx, BOS)
    assert result.tokens_scored == len(nlls) == 6
    assert calls == [ctx // 2 + 1, 1, 1] * 2  # each chunk's unscored half in one call
    assert result.perplexity == pytest.approx(expected, rel=1e-6)
    # Without BOS at the second chunk's start, the second chunk scores differently.
    assert score_llama_perplexity(fake_kv_model(), ids, ctx, None).perplexity != pytest.approx(expected, rel=1e-6)


def test_llama_perplexity_refuses_a_text_shorter_than_one_chunk():
    with pytest.raises(LlmcoreError, match="fewer than one chunk"):
        score_llama_perplexity(fake_kv_model(), list(range(7)), 8, BOS)


def test_eval_llama_perplexity_protocol(exports, cli):
    pte = exports("xnnpack").pte
    result = cli("eval", str(pte), "--text", str(TEXT), "--protocol", "llama-perplexity", "--ctx", "32",
                 "--max-tokens", "80", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["protocol"] == "llama-perplexity" and data["ctx"] == 32 and data["chunks"] == 2
    program, eager = data["program"], data["eager"]
    assert program["tokens_scored"] == eager["tokens_scored"] == 2 * (32 - 1 - 16)
    assert program["seconds"] >= 0 and eager["seconds"] >= 0
    assert 100 < eager["perplexity"] < 600
    assert abs(data["delta_pct"]) < 0.01  # fp32 program: the same model
    assert data["divergence"]["mean_kl"] < 1e-6 and data["divergence"]["top1_agreement"] == 1.0
    assert data["delta_pct_stderr"] < 0.01 and data["divergence"]["mean_kl_stderr"] < 1e-6

    text = cli("eval", str(pte), "--text", str(TEXT), "--protocol", "llama-perplexity", "--ctx", "32",
               "--max-tokens", "40", "--no-eager")
    assert text.returncode == 0, text.stderr
    assert "protocol llama-perplexity, ctx 32 (1 chunk)" in text.stdout and "program  perplexity" in text.stdout

    short = cli("eval", str(pte), "--text", str(TEXT), "--protocol", "llama-perplexity", "--ctx", "32",
                "--max-tokens", "20", "--no-eager")
    assert short.returncode == 2 and "fewer than one chunk" in short.stderr and "Fix:" in short.stderr


def test_compare_runs_both_in_lockstep_and_measures_kl_by_hand():
    """KL(eager || program) and top-1 agreement over the scored positions, against a direct
    computation; a program equal to its eager model has KL 0 and agrees everywhere."""
    from functools import partial

    from llmcore.apps.evaluate import compare, llama_perplexity_positions, score_llama_perplexity

    ids = [BOS] + [int(t) for t in torch.randint(1, VOCAB, (40,), generator=torch.Generator().manual_seed(3))]
    positions = partial(llama_perplexity_positions, ids=ids, ctx=16, bos_id=BOS)
    same_p, same_e, same = compare(positions, fake_kv_model(), fake_kv_model())
    assert same.mean_kl == pytest.approx(0.0, abs=1e-9) and same.top1_agreement == 1.0
    assert same_p.perplexity == pytest.approx(score_llama_perplexity(fake_kv_model(), ids, 16, BOS).perplexity)

    noise = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(4))
    base = fake_kv_model()

    def noisy(tokens, pos):
        return base(tokens, pos) + noise[pos + len(tokens) - 1]

    program, eager, div = compare(positions, noisy, fake_kv_model())
    kls, log_ratios, agree = [], [], 0
    for start in range(0, 32, 16):  # two chunks of 16, the second half of each scored
        chunk = [BOS] + ids[start + 1:start + 16]
        for pos in range(8, 15):
            le = torch.log_softmax(fake_logits(chunk[:pos + 1]), -1)
            lp = torch.log_softmax(fake_logits(chunk[:pos + 1]) + noise[pos], -1)
            kls.append(float((le.exp() * (le - lp)).sum()))
            log_ratios.append(float(le[chunk[pos + 1]] - lp[chunk[pos + 1]]))
            agree += int(le.argmax()) == int(lp.argmax())
    assert program.tokens_scored == eager.tokens_scored == len(kls) == 14
    assert div.mean_kl == pytest.approx(sum(kls) / len(kls), rel=1e-5)
    assert div.top1_agreement == pytest.approx(agree / len(kls))
    # the standard errors of the mean KL and of the mean log-likelihood difference
    assert div.mean_kl_stderr == pytest.approx(statistics.stdev(kls) / math.sqrt(len(kls)), rel=1e-4)
    assert div.log_ratio_stderr == pytest.approx(statistics.stdev(log_ratios) / math.sqrt(len(kls)), rel=1e-4)
    assert math.log(program.perplexity / eager.perplexity) == pytest.approx(sum(log_ratios) / len(kls), rel=1e-4)
    assert same.mean_kl_stderr == pytest.approx(0.0, abs=1e-9) and same.log_ratio_stderr == pytest.approx(0.0, abs=1e-9)
    assert eager.perplexity == pytest.approx(same_e.perplexity)
