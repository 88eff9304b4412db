"""moe_permute / moe_unpermute at the Qwen3-30B-A3B routing shape: T=16384 tokens, top-8 of E=128, D=2048.

Bytes (bf16 rows of D): permute reads T rows and writes N; its backward reads N, writes T.
unpermute reads N rows and writes T; its backward reads T (dout) and N (y, for the weight
gradient) and writes N. Index building (a few MB) is not counted.
Run on a CUDA machine: python3 packages/pith-ops/benchmarks/bench_moe_permute.py
"""

import functools

import torch
from harness import header, median_ms, report
from pith_ops.moe_permute import moe_permute, moe_permute_reference, moe_unpermute, moe_unpermute_reference

T, K, E, D = 16384, 8, 128, 2048


def fwd_and_fwd_bwd(name, fns, args, fwd_rows, bwd_rows):
    """Times each fn forward (no_grad) and forward+backward; the first fn is the op, the rest baselines."""
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    row_bytes = D * 2
    dy = torch.randn_like(next(iter(fns.values()))(*args))
    with torch.no_grad():
        fwd = {k: median_ms(functools.partial(f, *args)) for k, f in fns.items()}
    both = {k: median_ms(lambda f=f: torch.autograd.grad(f(*args), wrt, dy)) for k, f in fns.items()}
    op, *others = fns
    report(f"{name} fwd", fwd[op], bytes_moved=fwd_rows * row_bytes, baselines={k: fwd[k] for k in others})
    report(
        f"{name} fwd+bwd",
        both[op],
        bytes_moved=(fwd_rows + bwd_rows) * row_bytes,
        baselines={k: both[k] for k in others},
    )


def first(fn, *args):
    return fn(*args)[0]


def bench(ids_TK: torch.Tensor, align: int) -> None:
    N = T * K + (E * (align - 1) if align > 1 else 0)
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = functools.partial(first, moe_permute_reference)
    fns = {"pith": functools.partial(first, moe_permute), "eager": ref, "compile": torch.compile(ref)}
    fwd_and_fwd_bwd(f"moe_permute align={align}", fns, (x_TD, ids_TK, E, align), T + N, N + T)

    _, slots_TK, _ = moe_permute(x_TD.detach(), ids_TK, E, align)
    y_ND = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w_TK = torch.rand(T, K, device="cuda", requires_grad=True)
    fns = {
        "pith": moe_unpermute,
        "eager": moe_unpermute_reference,
        "compile": torch.compile(moe_unpermute_reference),
    }
    fwd_and_fwd_bwd(f"moe_unpermute align={align}", fns, (y_ND, slots_TK, w_TK), N + T, T + 2 * N)


def main() -> None:
    header(f"moe_permute / moe_unpermute, T={T} K={K} E={E} D={D} bf16")
    ids_TK = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    for align in (1, 128):
        bench(ids_TK, align)


if __name__ == "__main__":
    main()
