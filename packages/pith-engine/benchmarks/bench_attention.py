"""Which attention kernel to use on this card, per variant the models need (run on a CUDA machine).

For each variant at training shapes (bf16, 8192 tokens), times forward+backward of pith's
`attention()` (what the models call) against the alternatives, with CUDA events after warm-up
(triton.testing.do_bench, median), and prints TFLOP/s over the card's measured bf16 matmul rate:
- Qwen3-30B-A3B: GQA 32/4 heads x 128, causal: SDPA default / flash / efficient / cuDNN, flex;
- GPT-OSS-20B: GQA 64/8 x 64, window 128 and sinks: flex banded (+ sinks from the LSE) against
  full-causal SDPA and flex (what the band saves);
- DeepSeek-V2-Lite MLA: 16 heads, q/k 192, v 128, causal: SDPA as is, SDPA with v padded to 192
  (flash needs equal dims), flex.

    python packages/pith-engine/benchmarks/bench_attention.py
"""

import torch
import torch.nn.functional as F
import triton.testing
from pith_engine.attention import attention, flex_attention
from pith_engine.contract import Positions
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def matmul_tflops() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / median_ms(lambda: a @ b) / 1e9


def sdpa(q, k, v, scale, backend=None, pad_v_to=None):
    Dv = v.shape[-1]
    if pad_v_to:
        v = F.pad(v, (0, pad_v_to - Dv))
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    gqa = q.shape[2] != k.shape[2]
    if backend is None:
        out = F.scaled_dot_product_attention(*args, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(*args, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)[..., :Dv]


def run(title, B, S, H, G, D, Dv, window, sinks, candidates, ceiling):
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (make(*shape).requires_grad_() for shape in ((B, S, H, D), (B, S, G, D), (B, S, G, Dv)))
    sinks_H = torch.randn(H, device="cuda", requires_grad=True) if sinks else None
    pos = Positions(torch.arange(S, device="cuda").expand(B, S), None, None, None)
    scale = D**-0.5
    pairs = sum(min(i + 1, window or S) for i in range(S))  # visible (query, key) pairs
    flops = 3.5 * 2 * B * H * pairs * (D + Dv)  # QK^T and PV; backward ~2.5x forward
    print(f"\n== {title}: B={B} S={S} H={H} G={G} D={D} Dv={Dv} window={window} sinks={sinks}")
    fns = {"pith attention()": lambda: attention(q, k, v, pos, scale=scale, window=window, sinks_H=sinks_H)}
    fns.update({name: (lambda f=f: f(q, k, v, scale)) for name, f in candidates.items()})
    dout = make(B, S, H, Dv)
    wrt = [t for t in (q, k, v, sinks_H) if t is not None]
    base = None
    for name, fn in fns.items():
        try:
            ms = median_ms(lambda fn=fn: torch.autograd.grad(fn(), wrt, dout))
        except Exception as e:  # a backend that does not support the variant: say so, go on
            print(f"{name:<34} unsupported: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        base = base or ms
        tf = flops / ms / 1e9
        ratio = f"({tf / ceiling:4.0%} of matmul) x{base / ms:5.2f} vs the first"
        print(f"{name:<34} fwd+bwd {ms:8.3f} ms {tf:6.0f} TFLOP/s {ratio}")


def main():
    ceiling = matmul_tflops()
    print(
        f"card: {torch.cuda.get_device_name()}, bf16 matmul {ceiling:.0f} TFLOP/s, torch {torch.__version__}"
    )
    backends = {
        "SDPA flash": SDPBackend.FLASH_ATTENTION,
        "SDPA efficient": SDPBackend.EFFICIENT_ATTENTION,
        "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION,
    }
    causal = {"SDPA default": lambda q, k, v, s: sdpa(q, k, v, s)}
    causal.update({n: (lambda q, k, v, s, b=b: sdpa(q, k, v, s, b)) for n, b in backends.items()})
    causal["flex (compiled)"] = lambda q, k, v, s: flex_attention(q, k, v, scale=s, window=None, sinks_H=None)
    run("Qwen3-30B-A3B attention", 2, 4096, 32, 4, 128, 128, None, False, causal, ceiling)
    oss = {
        "SDPA full causal (no band)": lambda q, k, v, s: sdpa(q, k, v, s),
        "flex full causal (no band)": lambda q, k, v, s: flex_attention(
            q, k, v, scale=s, window=None, sinks_H=None
        ),
    }
    run("GPT-OSS-20B sliding layer", 2, 4096, 64, 8, 64, 64, 128, True, oss, ceiling)
    run("GPT-OSS-20B full layer", 2, 4096, 64, 8, 64, 64, None, True, oss, ceiling)
    mla = dict(causal)
    mla["SDPA v padded to 192"] = lambda q, k, v, s: sdpa(q, k, v, s, pad_v_to=q.shape[-1])
    mla["SDPA flash, v padded"] = lambda q, k, v, s: sdpa(q, k, v, s, SDPBackend.FLASH_ATTENTION, q.shape[-1])
    run("DeepSeek-V2-Lite MLA", 2, 4096, 16, 16, 192, 128, None, False, mla, ceiling)


if __name__ == "__main__":
    main()
