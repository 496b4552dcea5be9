"""The output layer's GEMV in the forms a GGUF's table takes on llmcore's kernels: Q6_K
super-blocks as the file holds them (csrc/int4_gemm.h, Format::q6_k) against int8 rows of the
same shape (what a Q6_K table was before 2026-12-07, and what 8da4w's output layer is), one
token, through ``llmcore::int4_linear``. It says whether the Q6_K GEMV reads at the memory's
speed: its 18% fewer bytes save as much time only if it does (docs/performance.md, "Q4_K_M
files": 22-23 GB/s against int8 rows' 24-27 on the AVX-512 EPYC, 2026-12-07).

    python benchmarks/int4_gemm_probe/output_layer_formats.py [--rows 128256] [--cols 2048]
        [--threads 2] [--calls 30]

(LLMCORE_KERNELS_MAX_ISA=avx2 or =portable for those paths.) Random weights, both formats'
outputs checked before timing against the values ``llmcore::q6_k_embedding`` decodes (the
gguf package's, bit for bit: plugins/kernels/tests/test_q6_k.py) times the same int8
activations; the calls alternate, and each format's median and minimum are printed."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode  # noqa: E402  (machine_header)


def q6_k_table(rows: int, cols: int) -> torch.Tensor:
    """Random well-formed Q6_K super-blocks, uint8 [rows, cols/256, 210] (the tests' maker)."""
    import gguf
    from llmcore_llama.testing import random_k_blocks

    blocks = random_k_blocks(gguf.GGMLQuantizationType.Q6_K, rows, cols, scale=1e-3)
    return torch.from_numpy(blocks).view(rows, cols // 256, 210)


def parse_timing_args(parser: argparse.ArgumentParser, super_block: str) -> argparse.Namespace:
    """``parser``'s arguments with the timing ones every format comparison here takes
    (``--threads``, ``--calls``), ``--cols`` checked to be whole super-blocks of 256; the
    threads set for torch's operators."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    if args.cols % 256:
        parser.error(f"--cols must be a multiple of 256 (a {super_block} super-block)")
    torch.set_num_threads(args.threads)
    return args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128256, help="outputs (Llama-3's vocabulary)")
    parser.add_argument("--cols", type=int, default=2048, help="inputs, a multiple of 256 (Llama-3.2-1B's width)")
    args = parse_timing_args(parser, "Q6_K")
    from llmcore_kernels import ops  # noqa: F401  (registers the operators)
    from llmcore_xnnpack.qlinear import int8_gemm

    blocks = q6_k_table(args.rows, args.cols)
    values = torch.cat([torch.ops.llmcore.q6_k_embedding.default(blocks, part)
                        for part in torch.arange(args.rows).split(4096)])
    sums = values.double().sum(1).float()
    scales = values.abs().amax(1).clamp(min=1e-12) / 127  # int8 rows of the same values
    q8 = (values / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    int8_sums = (q8.double() * scales.double()[:, None]).sum(1).float()
    x = torch.randn(1, args.cols, generator=torch.Generator().manual_seed(1))
    empty = torch.empty(0, dtype=torch.float16)
    forms = {
        "Q6_K": (lambda: torch.ops.llmcore.int4_linear.default(x, blocks, empty, sums, None, None), blocks.numel(),
                 values),
        "int8 rows": (lambda: torch.ops.llmcore.int4_linear.default(x, q8, scales, int8_sums, None, None),
                      q8.numel() + 8 * args.rows, q8.float() * scales[:, None]),
    }
    for name, (call, _, weight) in forms.items():  # each output checked before it is timed
        want = int8_gemm(x, weight, None, False)
        error = float((call() - want).norm() / want.norm())
        if error > 1e-4:
            print(f"{name}: the kernel's output is {error:.2g} from the reference: no timing", file=sys.stderr)
            return 1
    del values
    times = {name: [] for name in forms}
    for _ in range(args.calls):
        for name, (call, _, _) in forms.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    print(bench_decode.machine_header())
    print(f"# {args.rows} x {args.cols}, one token, {args.threads} thread(s), {args.calls} alternating calls each")
    for name, (_, size, _) in forms.items():
        median = statistics.median(times[name])
        print(f"{name:10s} {size / 2**20:8.1f} MiB  min {min(times[name]):7.2f} ms  median {median:7.2f} ms  "
              f"{size / median / 1e6:5.1f} GB/s")
    q6, i8 = (statistics.median(times[n]) for n in forms)
    print(f"Q6_K / int8 rows: time {q6 / i8:.3f}, bytes {forms['Q6_K'][1] / forms['int8 rows'][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
