"""The FP8 quantisation kernels at every shape `pith-train bench --fp8` runs them (Qwen3-30B-A3B, 16,384
tokens, 128 experts top-8: 132,992 expert rows with the 16-row padding, D=2048, expert F=768), each
checked bit-exact against its reference, in GB/s against the copy ceiling, with the per-step total (4
layers) against the same bytes at copy bandwidth; then the fusions: swiglu_fp8 against swiglu +
quantize_rows, and the optimizer's update pass with and without writing the FP8 weight copies
(pith_ops.adamw_) against quantize_weight on its own.

Bytes: quantize_rows reads x and writes e4m3 (scales not counted); cols_from_rows reads the e4m3 rows
and writes the transposed copy; quantize_weight reads the fp32 weight twice (its amax, then the copies)
and writes two e4m3 copies. Per layer: the forward quantises the activations by rows, the backward the
output gradients by rows, and the weight gradients take both by columns from those rows. The weights'
copies come from the optimizer (measured in the last section), not from the step.
Run on a CUDA machine: python3 packages/pith-ops/benchmarks/bench_fp8_quant.py
"""

import torch
from bench_fp8_recipe import N, T, uneven_ends  # N: moe_permute's static row count with align=16
from harness import ceilings, header, median_ms, report
from pith_ops import adamw_, cols_from_rows, cols_from_rows_reference, quantize_rows, quantize_rows_reference
from pith_ops.fp8_quant import FP8, quantize_weight, weight_amax
from pith_ops.swiglu import swiglu, swiglu_fp8

D, F, E, LAYERS = 2048, 768, 128, 4
EXPERTS = "experts"  # marks a shape whose rows are grouped by expert

# (name, shape, groups, quantisations per layer): each is a rows pass in the step and a columns pass
# in the weight gradient.
SHAPES = [
    ("expert x gate_up", (N, D), EXPERTS, 1),
    ("expert dy gate_up", (N, 2 * F), EXPERTS, 1),
    ("expert x down (rows: swiglu_fp8)", (N, F), EXPERTS, 1),
    ("expert dy down", (N, D), EXPERTS, 1),
    ("x of q/k/v", (T, D), None, 3),
    ("x of o, dy of q", (T, 4096), None, 2),
    ("dy of k/v", (T, 512), None, 2),
    ("dy of o", (T, D), None, 1),
]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8 else torch.equal(a, b)


def main() -> None:
    header("FP8 quantisation (e4m3, power-of-two scales), pith-train bench --fp8 shapes")
    ends_E = uneven_ends()
    step_ms, step_bytes = 0.0, 0.0
    for name, shape, groups, per_layer in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        ends = ends_E if groups == EXPERTS else torch.full((1,), shape[0], device="cuda", dtype=torch.int32)
        q, s = quantize_rows(x)
        assert all(map(same, (q, s), quantize_rows_reference(x)))
        qc, sc = cols_from_rows(q, s, ends)
        ref_q, ref_s = cols_from_rows_reference(q, s, ends)
        assert same(sc, ref_s) and same(qc[:, : int(ends[-1])], ref_q[:, : int(ends[-1])])
        tag = f"{name} {list(shape)}" + (f" {E} groups" if groups else "")
        rows_ms = median_ms(lambda x=x: quantize_rows(x))
        cols_ms = median_ms(lambda q=q, s=s, ends=ends: cols_from_rows(q, s, ends))
        report(f"rows {tag}", rows_ms, bytes_moved=x.numel() * 3)
        report(f"cols from rows {tag}", cols_ms, bytes_moved=x.numel() * 2)
        step_ms += (rows_ms * ("swiglu_fp8" not in name) + cols_ms) * per_layer * LAYERS
        step_bytes += x.numel() * (3 * ("swiglu_fp8" not in name) + 2) * per_layer * LAYERS
    copy = ceilings()["copy_GBps"]
    at_copy = step_bytes / copy / 1e6
    print(f"\nper step ({LAYERS} layers): {step_bytes / 1e9:.1f} GB, {at_copy:.2f} ms at copy;"
          f" measured {step_ms:.2f} ms ({step_bytes / step_ms / 1e6 / copy:.0%} of copy)")  # fmt: skip

    header(f"SwiGLU + row quantisation on x [{N}, 2*{F}] bf16")
    x = torch.randn(N, 2 * F, device="cuda", dtype=torch.bfloat16).mul_(3)
    y, y8, scale = swiglu_fp8(x)
    assert all(map(same, (y8, scale), quantize_rows(swiglu(x))))
    moved = N * F * (2 * 2 + 2 + 1)  # read gate and up, write y (bf16) and y8
    separate = median_ms(lambda: quantize_rows(swiglu(x)))
    report("swiglu, then quantize_rows", separate, bytes_moved=moved)
    report("swiglu_fp8 (one pass)", median_ms(lambda: swiglu_fp8(x)), bytes_moved=moved,
           baselines={"separate": separate})  # fmt: skip

    header("Expert weights' FP8 copies: quantize_weight alone, or written by the AdamW update pass")
    for name, shape in (("w_gate_up", (E, D, 2 * F)), ("w_down", (E, F, D))):
        weight_copies(name, torch.randn(shape, device="cuda") * 0.02)


def weight_copies(name: str, w: torch.Tensor) -> None:
    g, m, v = torch.randn_like(w).bfloat16(), torch.zeros_like(w), torch.zeros_like(w)
    copies = (*quantize_weight(w), weight_amax(w))
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, step=1)
    one = torch.ones(1, device="cuda")
    tag = f"{name} {list(w.shape)}"
    report(
        f"quantize_weight {tag}", median_ms(lambda: quantize_weight(w)), bytes_moved=w.numel() * (4 + 4 + 2)
    )
    plain = median_ms(lambda: adamw_(w, g, m, v, one, **kw))
    report(f"adamw_ {tag}, bf16 gradient", plain, bytes_moved=w.numel() * 26)
    with_fp8 = median_ms(lambda: adamw_(w, g, m, v, one, **kw, fp8=copies))
    report(f"adamw_ {tag} writing the FP8 copies", with_fp8, bytes_moved=w.numel() * 28,
           baselines={"adamw_ alone": plain})  # fmt: skip


if __name__ == "__main__":
    main()
