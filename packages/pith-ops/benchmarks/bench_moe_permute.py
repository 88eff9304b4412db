"""moe_permute / moe_unpermute at the Qwen3-30B-A3B routing shape: T=16384 tokens, top-8 of E=128, D=2048.

Bytes (bf16 rows of D; TK = T*K routed rows, N = TK plus padding rows when align > 1):
  permute forward      reads T rows, writes N (padding rows are written as zeros)
  permute backward     reads the TK routed rows of dx_ND (padding is never read), writes T
  unpermute forward    reads TK rows of y, writes T
  unpermute backward   reads dout (T) and the TK rows of y (for the weight gradient), writes dy (N)
Index building (a few MB of ids, histograms and slots) is not counted; its time is printed on its own
(moe_permute on rows of width 0: everything but the row copies).
Run on a CUDA machine: python3 packages/pith-ops/benchmarks/bench_moe_permute.py
"""

import functools

import torch
from harness import graph_ms, header, median_ms, report, report_fwd_bwd
from pith_ops.moe_permute import moe_permute, moe_permute_reference, moe_unpermute, moe_unpermute_reference

T, K, E, D = 16384, 8, 128, 2048
ROW = D * 2


def first(fn, *args):
    return fn(*args)[0]


def bench(ids_TK: torch.Tensor, align: int) -> None:
    TK = T * K
    N = TK + E * (align - 1)
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    index_args = (torch.empty(T, 0, device="cuda", dtype=torch.bfloat16), ids_TK, E, align)
    for timer, tag in ((median_ms, ""), (graph_ms, " [graph]")):
        report(f"moe_permute align={align} index building{tag}", timer(lambda: moe_permute(*index_args)))

    ref = functools.partial(first, moe_permute_reference)
    fns = {"pith": functools.partial(first, moe_permute), "eager": ref, "compile": torch.compile(ref)}
    report_fwd_bwd(
        f"moe_permute align={align}",
        fns,
        (x_TD, ids_TK, E, align),
        fwd_bytes=(T + N) * ROW,
        bwd_bytes=(TK + T) * ROW,
    )

    _, slots_TK, _ = moe_permute(x_TD.detach(), ids_TK, E, align)
    y_ND = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w_TK = torch.rand(T, K, device="cuda", requires_grad=True)
    fns = {
        "pith": moe_unpermute,
        "eager": moe_unpermute_reference,
        "compile": torch.compile(moe_unpermute_reference),
    }
    report_fwd_bwd(
        f"moe_unpermute align={align}",
        fns,
        (y_ND, slots_TK, w_TK),
        fwd_bytes=(TK + T) * ROW,
        bwd_bytes=(T + TK + N) * ROW,
    )


def main() -> None:
    header(f"moe_permute / moe_unpermute, T={T} K={K} E={E} D={D} bf16")
    ids_TK = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    for align in (1, 128):
        bench(ids_TK, align)


if __name__ == "__main__":
    main()
