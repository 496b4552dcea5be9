"""A Q4_K linear in the two forms llmcore's kernels take it: with the file's super-block headers
(csrc/int4_gemm.h, Format::q4_k: 4.5 bits a weight, each block's scale and offset computed
from the 6-bit codes) against int4 blocks of the same integers with a bfloat16 scale and a
float16 offset a block (5 bits a weight: what a Q4_K linear was before 2026-12-07), through
``llmcore::int4_linear``: one token (a decode step's GEMV, which reads the bytes once) and a
prompt. It says whether the headers' unpacking costs more than their 10% fewer bytes save.

    python benchmarks/int4_gemm_probe/q4_k_formats.py [--rows 16384] [--cols 2048]
        [--tokens 1,64] [--threads 2] [--calls 30]

(LLMCORE_KERNELS_MAX_ISA=avx2 or =portable for those paths.) Random well-formed Q4_K
super-blocks; each form's output checked before timing against the module the kernels
replace, computing with that form's values (the exact ones while it holds the headers); the
calls alternate, and each form's median and minimum are printed."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode  # noqa: E402  (machine_header)
from output_layer_formats import parse_timing_args  # noqa: E402


def q4_k_linear(rows: int, cols: int, headers: bool):
    """A BlockInt4Linear of random Q4_K super-blocks (the same ones each call), its headers
    kept (as the ``gguf`` recipe makes one for the kernels) or not (bf16 scales and float16
    offsets)."""
    import gguf
    from llmcore_llama.quants import integers_q4_k
    from llmcore_llama.testing import random_k_blocks
    from llmcore_xnnpack import qlinear

    raw = torch.from_numpy(random_k_blocks(gguf.GGMLQuantizationType.Q4_K, rows, cols, scale=1e-3))
    q, scales, offsets = integers_q4_k(raw.reshape(-1))
    kept = raw.view(rows, cols // 256, 144)[..., :16].contiguous() if headers else None
    return qlinear.BlockInt4Linear(q.view(rows, cols), scales.view(rows, -1), offsets.view(rows, -1), nibbles=True,
                                   q4_k_headers=kept)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16384, help="outputs (Llama-3.2-1B's gate and up together)")
    parser.add_argument("--cols", type=int, default=2048, help="inputs, a multiple of 256 (Llama-3.2-1B's width)")
    parser.add_argument("--tokens", default="1,64", help="comma-separated token counts to time")
    args = parse_timing_args(parser, "Q4_K")
    from llmcore_kernels.layers import KernelLinear

    modules = {"Q4_K": q4_k_linear(args.rows, args.cols, headers=True),
               "int4 blocks": q4_k_linear(args.rows, args.cols, headers=False)}  # the same integers
    forms = {name: (KernelLinear(module), module) for name, module in modules.items()}
    sizes = {name: sum(b.numel() * b.element_size() for n, b in kernel.named_buffers() if b is not None)
             for name, (kernel, _) in forms.items()}
    print(bench_decode.machine_header())
    print(f"# {args.rows} x {args.cols}, {args.threads} thread(s), {args.calls} alternating calls each")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(1, tokens, args.cols, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            for name, (kernel, module) in forms.items():  # each output checked before it is timed
                want = module(x)
                error = float((kernel(x) - want).norm() / want.norm())
                if error > 1e-4:
                    print(f"{name}: the kernel's output is {error:.2g} from its module: no timing", file=sys.stderr)
                    return 1
            times = {name: [] for name in forms}
            for _ in range(args.calls):
                for name, (kernel, _) in forms.items():
                    start = time.perf_counter()
                    kernel(x)
                    times[name].append((time.perf_counter() - start) * 1e3)
        for name in forms:
            median = statistics.median(times[name])
            print(f"{tokens:3d} token(s)  {name:11s} {sizes[name] / 2**20:7.1f} MiB  min {min(times[name]):7.3f} ms  "
                  f"median {median:7.3f} ms  {sizes[name] / median / 1e6:5.1f} GB/s")
        ours, before = (statistics.median(times[n]) for n in forms)
        fastest = min(times["Q4_K"]) / min(times["int4 blocks"])
        print(f"{tokens:3d} token(s)  Q4_K / int4 blocks: time {ours / before:.3f} (min {fastest:.3f}), "
              f"bytes {sizes['Q4_K'] / sizes['int4 blocks']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
