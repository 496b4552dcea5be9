"""Which ISA views a CPU can present (llmcore/testing/isa_view.py): each view the tests and
benchmarks run must be one the CPU can show by hiding features, and none that would only
repeat the native one."""

from __future__ import annotations

import pytest

from llmcore.testing import isa_view

BASE = "sse4_2 popcnt avx avx2 fma f16c bmi2"
CPUS = {
    # the project's AVX2-only EPYC (Zen 2/3): only the pre-AVX view is older
    "AVX2-only EPYC": (BASE, ["native", "sse4"]),
    # Zen 4: AVX-512 with VNNI and BF16, no AMX, no AVX-VNNI: the avx512 view would be native
    "AVX-512 EPYC": (f"{BASE} avx512f avx512bw avx512vl avx512_vnni avx512_bf16", ["native", "avx2", "sse4"]),
    # Sapphire / Emerald Rapids: every view
    "Xeon with AMX": (f"{BASE} avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 avx_vnni amx_tile "
                      "amx_int8 amx_bf16", ["native", "avx512", "avxvnni", "avx2", "sse4"]),
    # Alder Lake and later laptop cores: AVX-VNNI without AVX-512; the avxvnni view would be native
    "Intel laptop core": (f"{BASE} avx_vnni", ["native", "avx2", "sse4"]),
}


@pytest.mark.parametrize("cpu", CPUS)
def test_a_cpu_presents_the_views_older_than_itself(monkeypatch, cpu):
    flags, views = CPUS[cpu]
    monkeypatch.setattr(isa_view, "proc_flags", lambda: set(flags.split()))
    assert isa_view.presentable_views() == views


def test_every_view_has_its_needs_and_its_library_caps():
    for view, hidden in isa_view.VIEWS.items():
        assert view in isa_view.NEEDS
        if hidden is not None:
            assert set(isa_view.LIBRARY_ENV[view]) >= {"ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                                       "ONEDNN_MAX_CPU_ISA"}
