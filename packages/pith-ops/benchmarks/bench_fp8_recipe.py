"""The FP8 recipe, decided by measurement: torch's row-wise scaled GEMMs (with and without fast
accumulation) against bf16 at the bench's shapes and their error against a float64 dequantised
reference (the quantisation kernels: bench_fp8_quant.py).

Shapes: experts, T=16384 tokens x top-8 = 131,072 rows over 128 groups (equal, 1024 each, and the
uneven groups of a random top-8 routing, padded to 16 rows: the FP8 wgrad needs it): gate_up
K=2048 -> N=1536 and down K=768 -> N=2048, each as forward (2-D x 3-D) and wgrad (2-D x 2-D,
contracting over each group's rows), and the dgrad shapes; dense: the attention projections of
Qwen3-30B-A3B at 16,384 tokens and one lm_head chunk (3,533 x 2048 -> 151,936).
Run on a CUDA machine: python3 packages/pith-ops/benchmarks/bench_fp8_recipe.py
"""

import torch
from harness import header, median_ms, report
from pith_ops.fp8_quant import cols_from_rows, quantize_rows, quantize_weight

T, TOPK, E = 16384, 8, 128
N = T * TOPK + E * 15  # routed rows plus the most padding 16-row groups can add
BF16 = torch.bfloat16


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def uneven_ends() -> torch.Tensor:
    """Group ends of a random top-8 routing, each group padded to 16 rows (the FP8 wgrad's alignment)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(T, E, device="cuda", generator=g).topk(TOPK, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=E)
    return ((counts + 15) // 16 * 16).cumsum(0).to(torch.int32)


def grouped(name: str, I: int, O: int, ends: torch.Tensor) -> None:
    x = torch.randn(N, I, device="cuda", dtype=BF16)
    w = torch.randn(E, I, O, device="cuda", dtype=BF16) / I**0.5
    dy = torch.randn(N, O, device="cuda", dtype=BF16)
    flops = 2 * N * I * O
    xq, sx = quantize_rows(x)
    _, _, wq, sw = quantize_weight(w)  # [E, O, I], [E, O]
    bf = median_ms(lambda: torch._grouped_mm(x, w, offs=ends))
    ref = torch.cat([xq[a:b].double() * sx[a:b, None].double() @ (wq[e].double() * sw[e].double()[:, None]).T
                     for e, (a, b) in enumerate(zip([0, *ends[:-1].tolist()], ends.tolist()))])  # fmt: skip
    for fast in (False, True):
        f = lambda fast=fast: torch._scaled_grouped_mm(xq, wq.transpose(1, 2), sx, sw, offs=ends,
                                             out_dtype=BF16, use_fast_accum=fast)  # fmt: skip
        report(f"{name} fwd fp8 fast={fast}", median_ms(f), flops=flops, baselines={"bf16": bf})
        print(f"    rel. error vs dequantised float64: {rel_err(f()[: ref.shape[0]], ref):.2e}")
    report(f"{name} fwd bf16", bf, flops=flops)
    # wgrad: dw[e] = x[rows of e].T @ dy[rows of e], operands quantised along the group's rows.
    xt, sxt = cols_from_rows(*quantize_rows(x), ends)  # [I, N], [G, I]
    dyt, sdyt = cols_from_rows(*quantize_rows(dy), ends)  # [O, N], [G, O]
    bf = median_ms(lambda: torch._grouped_mm(x.t(), dy, offs=ends))
    for fast in (False, True):
        f = lambda fast=fast: torch._scaled_grouped_mm(xt, dyt.t(), sxt.flatten(), sdyt.flatten(), offs=ends,
                                             out_dtype=BF16, use_fast_accum=fast)  # fmt: skip
        report(f"{name} wgrad fp8 fast={fast}", median_ms(f), flops=flops, baselines={"bf16": bf})
    report(f"{name} wgrad bf16", bf, flops=flops)


def dense(name: str, M: int, K: int, Nout: int) -> None:
    x = torch.randn(M, K, device="cuda", dtype=BF16)
    w = torch.randn(Nout, K, device="cuda", dtype=BF16) / K**0.5
    xq, sx = quantize_rows(x)
    wq, sw = quantize_rows(w)
    bf = median_ms(lambda: x @ w.T)
    ref = (xq.double() * sx[:, None].double()) @ (wq.double() * sw[:, None].double()).T
    for fast in (False, True):
        f = lambda fast=fast: torch._scaled_mm(
            xq, wq.T, sx[:, None], sw[None, :], out_dtype=BF16, use_fast_accum=fast
        )
        report(f"{name} fp8 fast={fast}", median_ms(f), flops=2 * M * K * Nout, baselines={"bf16": bf})
        print(f"    rel. error vs dequantised float64: {rel_err(f(), ref):.2e}")
    report(f"{name} bf16", bf, flops=2 * M * K * Nout)


if __name__ == "__main__":
    header("FP8 recipe: row-wise scaled GEMMs")
    equal = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (T * TOPK // E)
    for ends, tag in ((equal, "equal groups"), (uneven_ends(), "random top-8 groups")):
        grouped(f"gate_up 2048->1536 {tag}", 2048, 1536, ends)
        grouped(f"down 768->2048 {tag}", 768, 2048, ends)
    grouped("dgrad gate_up 1536->2048", 1536, 2048, equal)
    grouped("dgrad down 2048->768", 2048, 768, equal)
    dense("q_proj", T, 2048, 4096)
    dense("k_proj", T, 2048, 512)
    dense("o_proj", T, 4096, 2048)
    dense("wgrad q_proj", 4096, T, 2048)
    dense("lm_head chunk", 3533, 2048, 151936)
