"""Both samplers (the C++ runner's, through ``build/llmcore_sample``, and ``llmcore run``'s
``Sampling``) against the distribution their options define, computed here in float64:
softmax of ``logits / temperature``, cut to the ``top_k`` best, then to the nucleus (the
best tokens, each kept while the mass before it is below ``top_p``).

Neither sampler sorts the vocabulary: they rank only as many of the best tokens as the
nucleus needs (64, then 512, ...). The wide nuclei here make both go through every step."""

import subprocess

import numpy as np
import pytest
import torch

from llmcore.runtime.generate import Sampling, nucleus
from test_runner import binaries, built_tool  # noqa: F401


@pytest.fixture(scope="module")
def sample_tool(binaries):  # noqa: F811
    return built_tool("llmcore_sample")


def expected(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution the options define, by a full sort (best first, ties by lower id)."""
    scores = logits.astype(np.float64) / temperature
    order = np.lexsort((np.arange(len(scores)), -scores))
    if top_k:
        order = order[:top_k]
    p = np.exp(scores[order] - scores[order[0]])
    p /= p.sum()
    if top_p < 1.0:
        keep = np.cumsum(p) - p < top_p
        order, p = order[keep], p[keep] / p[keep].sum()
    out = np.zeros(len(scores))
    out[order] = p
    return out


def assert_drawn_from(ids: np.ndarray, want: np.ndarray) -> None:
    """Every id inside the support; each likely token's frequency, and the mass of each
    tenth of the other tokens (ranked by probability), within 5 standard errors."""
    n = len(ids)
    outside = set(ids.tolist()) - set(np.flatnonzero(want).tolist())
    assert not outside, f"sampled outside the support: {sorted(outside)[:10]}"
    freq = np.bincount(ids, minlength=len(want)) / n

    def check(got, p, what):
        tolerance = 5 * np.sqrt(p * (1 - p) / n) + 1e-3
        assert np.all(np.abs(got - p) <= tolerance), f"{what}: drawn {got} against {p}"

    likely = want >= 0.005
    check(freq[likely], want[likely], "likely tokens")
    rest = np.flatnonzero(~likely & (want > 0))
    rest = rest[np.argsort(-want[rest], kind="stable")]
    tenths = [t for t in np.array_split(rest, 10) if len(t)]
    check(np.array([freq[t].sum() for t in tenths]), np.array([want[t].sum() for t in tenths]), "tenths of the rest")


def peaked_logits(vocab: int = 2000, seed: int = 0) -> np.ndarray:
    """A few likely tokens over a long tail, as a language model's."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(vocab) * 2.5).astype(np.float32)


def flat_logits(vocab: int = 3000, seed: int = 1) -> np.ndarray:
    """A nucleus of thousands of tokens: the samplers must grow past 64 and 512 candidates."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(vocab) * 0.3).astype(np.float32)


CASES = [
    ("temperature", peaked_logits(), dict(temperature=0.8)),
    ("top-k", peaked_logits(), dict(temperature=1.0, top_k=20)),
    ("top-p", peaked_logits(), dict(temperature=1.0, top_p=0.9)),
    ("top-k and top-p", peaked_logits(), dict(temperature=0.7, top_k=50, top_p=0.8)),
    ("wide nucleus", flat_logits(), dict(temperature=1.0, top_p=0.9)),
]


def run_sample_tool(tool, logits: np.ndarray, n: int, tmp_path, seed: int = 5, **options) -> np.ndarray:
    path = tmp_path / "logits.f32"
    logits.astype("<f4").tofile(path)
    args = [str(tool), str(path), str(n), "--seed", str(seed)]
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return np.array([int(t) for t in out.split()])


@pytest.mark.parametrize("name,logits,options", CASES, ids=[c[0] for c in CASES])
def test_runner_sampler_draws_from_the_defined_distribution(sample_tool, tmp_path, name, logits, options):
    ids = run_sample_tool(sample_tool, logits, 60000, tmp_path, **options)
    assert_drawn_from(ids, expected(logits, **options))


@pytest.mark.parametrize("name,logits,options", CASES, ids=[c[0] for c in CASES])
def test_python_sampler_draws_from_the_defined_distribution(name, logits, options):
    sampling = Sampling(seed=5, **options)
    tensor = torch.from_numpy(logits)
    ids = np.array([sampling(tensor) for _ in range(20000)])
    assert_drawn_from(ids, expected(logits, **options))


def test_a_wide_nucleus_is_found_whole(sample_tool, tmp_path):
    """With thousands of tokens in the nucleus, both samplers keep exactly the nucleus: the
    Python cut equals the full-sort one, and the runner draws the nucleus's last members and
    never the first token past it."""
    logits = flat_logits()
    want = expected(logits, 1.0, top_p=0.9)
    members = np.flatnonzero(want)
    assert 512 < len(members) < len(logits)  # past both of the first two candidate counts
    probs = torch.softmax(torch.from_numpy(logits).double(), -1)
    assert torch.equal(nucleus(probs, 0.9) > 0, torch.from_numpy(want > 0))
    ids = run_sample_tool(sample_tool, logits, 200000, tmp_path, top_p=0.9)
    scores = logits.astype(np.float64)
    ranked = members[np.lexsort((members, -scores[members]))]
    drawn = set(ids.tolist())
    assert set(ranked[-20:].tolist()) <= drawn  # the least likely members are still drawn
    assert drawn <= set(members.tolist())


def test_a_seed_repeats_its_draws(sample_tool, tmp_path):
    logits = peaked_logits()
    a = run_sample_tool(sample_tool, logits, 50, tmp_path, seed=3, temperature=0.9, top_p=0.95)
    b = run_sample_tool(sample_tool, logits, 50, tmp_path, seed=3, temperature=0.9, top_p=0.95)
    c = run_sample_tool(sample_tool, logits, 50, tmp_path, seed=4, temperature=0.9, top_p=0.95)
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
