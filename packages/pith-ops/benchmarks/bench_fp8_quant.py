"""quantize_rows / quantize_cols at every shape `pith-train bench --fp8` quantises (Qwen3-30B-A3B, 16,384
tokens, 128 experts top-8: 132,992 expert rows with the 16-row padding, D=2048, expert F=768), each
checked bit-exact against the reference, in GB/s against the copy ceiling, and the per-step total
(4 layers) against the same bytes at copy bandwidth.

Bytes: one read of x and one e4m3 write (scales not counted). Per layer each FP8 GEMM operand is
quantised along both axes: fp8_linear (q, k, v, o projections) quantises x and w in the forward and
dy in the backward, fp8_grouped_gemm (gate_up, down) the same with the expert weights batched.
--baseline FILE: also time the quantize_rows / quantize_cols of another fp8_quant.py in the same
process (a candidate rewrite against the module's kernels).
Run on a CUDA machine: python3 packages/pith-ops/benchmarks/bench_fp8_quant.py [--baseline FILE]
"""

import argparse
import importlib.util

import torch
from bench_fp8_recipe import E, N, T, uneven_ends  # N: moe_permute's static row count with align=16
from harness import ceilings, header, median_ms, report
from pith_ops import fp8_quant
from pith_ops.fp8_quant import quantize_cols, quantize_cols_reference, quantize_rows, quantize_rows_reference

D, F, LAYERS = 2048, 768, 4
BF16, FP32 = torch.bfloat16, torch.float32
EXPERTS = "experts"  # marks a shape whose rows are grouped by expert


# (name, shape, dtype, groups, quantisations of each kind per layer)
SHAPES = [
    ("expert x gate_up", (N, D), BF16, EXPERTS, 1),
    ("expert dy gate_up", (N, 2 * F), BF16, EXPERTS, 1),
    ("expert x down", (N, F), BF16, EXPERTS, 1),
    ("expert dy down", (N, D), BF16, EXPERTS, 1),
    ("expert w gate_up", (E, D, 2 * F), FP32, None, 1),
    ("expert w down", (E, F, D), FP32, None, 1),
    ("x of q/k/v", (T, D), BF16, None, 3),
    ("x of o, dy of q", (T, 4096), BF16, None, 2),
    ("dy of k/v", (T, 512), BF16, None, 2),
    ("dy of o", (T, D), BF16, None, 1),
    ("w q", (4096, D), FP32, None, 1),
    ("w k/v", (512, D), FP32, None, 2),
    ("w o", (D, 4096), FP32, None, 1),
]


def check_exact(x: torch.Tensor, ends: torch.Tensor | None) -> None:
    q, s = quantize_rows(x.flatten(0, -2))
    ref_q, ref_s = quantize_rows_reference(x.flatten(0, -2))
    assert torch.equal(s, ref_s) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    q, s = quantize_cols(x, ends)
    x3 = x if x.ndim == 3 else x[None]
    e = ends if ends is not None else torch.full((1,), x3.shape[1], device="cuda", dtype=torch.int32)
    ref_q, ref_s = quantize_cols_reference(x3, e)
    used = int(e[-1])  # rows past the last end are left unwritten
    q = q.reshape(ref_q.shape)[..., :used]
    assert torch.equal(s.reshape(ref_s.shape), ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q[..., :used].view(torch.uint8))


def load(path: str):
    spec = importlib.util.spec_from_file_location("fp8_quant_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="another fp8_quant.py to time in the same process")
    args = ap.parse_args()
    impls = {"current": fp8_quant}
    if args.baseline:
        impls["baseline"] = load(args.baseline)
    header("FP8 quantisation (e4m3, power-of-two scales), pith-train bench --fp8 shapes")
    ends_E = uneven_ends()
    step_ms = {k: 0.0 for k in impls}
    step_bytes = 0.0
    for name, shape, dtype, groups, per_layer in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        ends = ends_E if groups == EXPERTS else None
        check_exact(x, ends)
        moved = x.numel() * (x.element_size() + 1)
        calls = {
            "rows": lambda m, x=x: m.quantize_rows(x.flatten(0, -2)),
            "cols": lambda m, x=x, ends=ends: m.quantize_cols(x, ends),
        }
        tag = f"{name} {list(shape)} {str(dtype)[6:]}" + (f" {E} groups" if ends is not None else "")
        for kind, call in calls.items():
            ms = {impl: median_ms(lambda m=m, call=call: call(m)) for impl, m in impls.items()}
            for impl in impls:
                step_ms[impl] += ms[impl] * per_layer * LAYERS
            base = {k: v for k, v in ms.items() if k != "current"}
            report(f"{kind} {tag}", ms["current"], bytes_moved=moved, baselines=base)
        step_bytes += 2 * moved * per_layer * LAYERS
    copy = ceilings()["copy_GBps"]
    at_copy = step_bytes / copy / 1e6
    print(f"\nper step ({LAYERS} layers): {step_bytes / 1e9:.1f} GB, {at_copy:.2f} ms at copy")
    for impl, ms in step_ms.items():
        gbps = step_bytes / ms / 1e6
        print(f"  {impl}: {ms:.2f} ms, {gbps:.0f} GB/s ({gbps / copy:.0%} of copy)")


if __name__ == "__main__":
    main()
