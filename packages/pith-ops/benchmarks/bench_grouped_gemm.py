"""grouped_gemm at the Qwen3-30B-A3B expert shapes: T=16384 tokens x top-8 over E=128 experts.

gate_up: [T*K, 2048] x [128, 2048, 1536]; down: [T*K, 768] x [128, 768, 2048]. Group sizes come from
a random top-8 routing (uneven, as in training), unpadded (align 1) and padded to 128 rows.
Compared: torch's grouped matmul (torch._grouped_mm) and the Triton kernel behind pith's op, and the
per-expert loop (the reference). FLOPs: 2*T*K*I*O forward, 3x that forward+backward.
Run on a CUDA machine: python3 packages/pith-ops/benchmarks/bench_grouped_gemm.py
"""

import torch
from harness import header, median_ms, report
from pith_ops import _common, grouped_gemm, grouped_gemm_reference
from pith_ops.moe_permute import moe_permute

T, K, E = 16384, 8, 128
SHAPES = {"gate_up": (2048, 1536), "down": (768, 2048)}


def forward(impl: str, x, w, ends_E):
    return grouped_gemm_reference(x, w, ends_E) if impl == "loop" else grouped_gemm(x, w, ends_E)


def timed(impl: str, fn) -> float:
    """Median ms of fn with grouped_gemm's one implementation switch set for impl (forward and
    backward both run under it), restored after."""
    saved, _common.USE_TORCH_GROUPED_MM = _common.USE_TORCH_GROUPED_MM, impl == "torch"
    try:
        return median_ms(fn)
    finally:
        _common.USE_TORCH_GROUPED_MM = saved


def bench(name: str, I: int, O: int, ends_E: torch.Tensor, align: int) -> None:
    N = T * K + E * (align - 1)
    x = torch.randn(N, I, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, I, O, device="cuda", dtype=torch.bfloat16) / I**0.5).requires_grad_()
    dy = torch.randn(N, O, device="cuda", dtype=torch.bfloat16)
    flops = 2 * T * K * I * O
    fwd, both = {}, {}
    for impl in ("triton", "torch", "loop"):
        try:
            with torch.no_grad():
                fwd[impl] = timed(impl, lambda impl=impl: forward(impl, x, w, ends_E))
            both[impl] = timed(
                impl, lambda impl=impl: torch.autograd.grad(forward(impl, x, w, ends_E), (x, w), dy)
            )
        except Exception as err:  # report an unsupported layout and go on with the others
            print(f"  {impl} failed at {name} align={align}: {type(err).__name__}: {err}")
    for impl in ("triton", "torch"):
        if impl in both:
            label = f"{name} align={align} {impl}"
            report(
                f"{label} fwd", fwd[impl], flops=flops, baselines={k: v for k, v in fwd.items() if k != impl}
            )
            rest = {k: v for k, v in both.items() if k != impl}
            report(f"{label} fwd+bwd", both[impl], flops=3 * flops, baselines=rest)


def main() -> None:
    header(f"grouped_gemm, T={T} K={K} E={E} bf16")
    ids_TK = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    for align in (1, 128):
        _, _, ends_E = moe_permute(torch.zeros(T, 8, device="cuda", dtype=torch.bfloat16), ids_TK, E, align)
        for name, (I, O) in SHAPES.items():
            bench(name, I, O, ends_E, align)


if __name__ == "__main__":
    main()
