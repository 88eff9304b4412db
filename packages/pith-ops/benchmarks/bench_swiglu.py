"""swiglu and swiglu_oss at the Qwen3-30B-A3B expert shape: T=16384 tokens x top-8 rows, F=768.

Bytes per row (bf16): forward reads 2F and writes F; backward reads x (2F) and dy (F), writes dx (2F).
Run on a CUDA machine: python3 packages/pith-ops/benchmarks/bench_swiglu.py
"""

import torch
from harness import header, report_fwd_bwd
from pith_ops.swiglu import swiglu, swiglu_oss, swiglu_oss_reference, swiglu_reference

N, F = 16384 * 8, 768


def main() -> None:
    header(f"swiglu on x [{N}, 2*{F}] bf16")
    x = torch.randn(N, 2 * F, device="cuda", dtype=torch.bfloat16).mul_(3).requires_grad_()
    row_bytes = 2 * x.element_size() * F
    for name, op, reference in (
        ("swiglu", swiglu, swiglu_reference),
        ("swiglu_oss", swiglu_oss, swiglu_oss_reference),
    ):
        fns = {"pith": op, "eager": reference, "compile": torch.compile(reference)}
        report_fwd_bwd(name, fns, (x,), fwd_bytes=N * 1.5 * row_bytes, bwd_bytes=N * 2.5 * row_bytes)


if __name__ == "__main__":
    main()
