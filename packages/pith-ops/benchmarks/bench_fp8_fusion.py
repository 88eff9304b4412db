"""What the FP8 fusions and the weight cache save, at the bench's expert shapes (T=16384 x top-8 rows):
- swiglu then quantize_rows of its output (the down projection's e4m3 rows) against swiglu_fp8,
  which writes both from one pass, on x [131072, 2*768] bf16;
- the expert weights' quantisation (both layouts, from fp32), what each micro-batch after the first
  of an optimizer step no longer pays (pith_engine.layers.FP8Switch.fp8_weight).
Bytes are what the work must move at least. Run on a CUDA machine (~15 s):
python3 packages/pith-ops/benchmarks/bench_fp8_fusion.py
"""

import torch
from harness import header, median_ms, report
from pith_ops.fp8_grouped_gemm import fp8_grouped_gemm_weight
from pith_ops.fp8_quant import quantize_rows
from pith_ops.swiglu import swiglu, swiglu_fp8

N, F, E, D = 16384 * 8, 768, 128, 2048


def main() -> None:
    header(f"SwiGLU + row quantisation on x [{N}, 2*{F}] bf16; expert weights [{E}, ...] fp32")
    x = torch.randn(N, 2 * F, device="cuda", dtype=torch.bfloat16).mul_(3)
    y, y8, scale = swiglu_fp8(x)
    q, s = quantize_rows(swiglu(x))
    assert torch.equal(y8.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale, s)
    moved = N * F * (2 * 2 + 2 + 1)  # read gate and up, write y (bf16) and y8
    separate = median_ms(lambda: quantize_rows(swiglu(x)))
    report("swiglu, then quantize_rows", separate, bytes_moved=moved)
    report(
        "swiglu_fp8 (one pass)",
        median_ms(lambda: swiglu_fp8(x)),
        bytes_moved=moved,
        baselines={"separate": separate},
    )
    for name, shape in (("w_gate_up", (E, D, 2 * F)), ("w_down", (E, F, D))):
        w = torch.randn(shape, device="cuda")
        moved = w.numel() * (4 + 2)  # read fp32 once, write two e4m3 copies
        report(
            f"fp8_grouped_gemm_weight {name} {list(shape)}",
            median_ms(lambda w=w: fp8_grouped_gemm_weight(w)),
            bytes_moved=moved,
        )


if __name__ == "__main__":
    main()
