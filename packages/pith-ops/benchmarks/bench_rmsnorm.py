"""rms_norm at the Qwen3-30B-A3B shapes: the layer norm [16384, 2048], and the per-head q norm
(16384 tokens x 32 heads rows of 128).

Bytes (bf16): forward reads x and writes y; backward reads x and dy and writes dx (the weight and its
gradient are negligible). Run on a CUDA machine: python3 packages/pith-ops/benchmarks/bench_rmsnorm.py
"""

import torch
from harness import header, report_fwd_bwd
from pith_ops.rmsnorm import rms_norm, rms_norm_reference


def main() -> None:
    for N, D in ((16384, 2048), (16384 * 32, 128)):
        header(f"rms_norm on x [{N}, {D}] bf16, weight [{D}] bf16")
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).mul_(2).requires_grad_()
        w = torch.randn(D, device="cuda", dtype=torch.bfloat16).mul_(0.1).add_(1).requires_grad_()
        fns = {
            "pith": lambda x, w: rms_norm(x, w, 1e-6),
            "eager": lambda x, w: rms_norm_reference(x, w, 1e-6),
            "compile": torch.compile(lambda x, w: rms_norm_reference(x, w, 1e-6)),
        }
        nbytes = x.numel() * x.element_size()
        report_fwd_bwd("rms_norm", fns, (x, w), fwd_bytes=2 * nbytes, bwd_bytes=3 * nbytes)


if __name__ == "__main__":
    main()
