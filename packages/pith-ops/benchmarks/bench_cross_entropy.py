"""linear_cross_entropy at the Qwen3 vocabulary: V=151936, D=2048, T=16384 (and 4096) tokens, bf16.

FLOPs: 2*T*V*D per matmul; the fused op runs three (logits, dh, dw) in its forward, so its
forward+backward is three matmuls and its no-grad forward one. Baselines: plain PyTorch (bf16
lm_head matmul, then F.cross_entropy on the full fp32 logits), torch.compile of that, and a chunked
plain version (torch.utils.checkpoint per 4096-token chunk, so one chunk's logits live at a time).
Peak memory is printed per implementation (the full-logits baselines need ~10 GB per 16K tokens).
"pith fp8" is the fused op with w8 = quantize_weight(w) (FP8 logits and dh GEMMs, module docstring of
pith_ops.cross_entropy), the weight quantised once outside the timing as a training step would
(timed on its own); its rows compare it with the bf16 "pith" among the baselines.
Run on a CUDA machine: python3 packages/pith-ops/benchmarks/bench_cross_entropy.py
"""

import torch
import torch.nn.functional as F
from harness import header, median_ms, report
from pith_ops.cross_entropy import linear_cross_entropy
from pith_ops.fp8_quant import quantize_weight
from torch.utils.checkpoint import checkpoint

V, D = 151936, 2048


def plain(h, w, labels):
    return F.cross_entropy((h @ w.T).float(), labels)


def chunk_loss(h, w, labels):
    return F.cross_entropy((h @ w.T).float(), labels, reduction="sum")


def chunked(h, w, labels, chunk=4096):
    """Sum of per-chunk losses, each chunk's logits recomputed in the backward (checkpoint)."""
    total = sum(
        checkpoint(chunk_loss, h[i : i + chunk], w, labels[i : i + chunk], use_reentrant=False)
        for i in range(0, h.shape[0], chunk)
    )
    return total / (labels != -100).sum()


def peak_gb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def bench(T: int) -> None:
    h = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, D, device="cuda", dtype=torch.bfloat16) / D**0.5).requires_grad_()
    labels = torch.randint(0, V, (T,), device="cuda")
    labels[::7] = -100
    args = (h, w, labels)
    w8 = quantize_weight(w.detach())
    fns = {
        "pith": linear_cross_entropy,
        "pith fp8": lambda h, w, labels: linear_cross_entropy(h, w, labels, w8=w8),
        "plain": plain,
        "compile": torch.compile(plain),
        "chunked": chunked,
    }
    with torch.no_grad():
        fwd = {k: median_ms(lambda f=f: f(*args)) for k, f in fns.items()}
    both = {k: median_ms(lambda f=f: torch.autograd.grad(f(*args), (h, w))) for k, f in fns.items()}
    peaks = {k: peak_gb(lambda f=f: torch.autograd.grad(f(*args), (h, w))) for k, f in fns.items()}
    mm = 2 * T * V * D
    for name in ("pith", "pith fp8"):
        others = [k for k in fns if k != name]
        report(f"T={T} {name} fwd (no grad)", fwd[name], flops=mm, baselines={k: fwd[k] for k in others})
        report(f"T={T} {name} fwd+bwd", both[name], flops=3 * mm, baselines={k: both[k] for k in others})
    quantize_ms = median_ms(lambda: quantize_weight(w.detach()))
    # Bytes: bf16 w read twice (its amax, then the cast), two e4m3 copies written.
    report("quantize_weight(w), once a step", quantize_ms, bytes_moved=6 * V * D)
    print("  peak extra memory fwd+bwd, GB: " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()))
    ref = plain(h.float(), w.float(), labels).item()
    losses = ", ".join(f"{k} {fns[k](*args).item():.6f}" for k in ("pith", "pith fp8"))
    print(f"  loss: {losses}, fp32 reference {ref:.6f}")


def main() -> None:
    header(f"linear_cross_entropy, V={V} D={D} bf16")
    for T in (4096, 16384):
        bench(T)


if __name__ == "__main__":
    main()
