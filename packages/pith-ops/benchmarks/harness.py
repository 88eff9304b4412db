"""Shared timing harness for the operator benchmarks (run on a CUDA machine).

Times with CUDA events after warm-up (triton.testing.do_bench, median), on random data, and reports
each measurement against the card's measured ceilings: device-copy bandwidth (bytes read + written
by a large clone) and the bf16 dense matmul rate (8192^3).
"""

import functools

import torch
import triton.testing


def median_ms(fn, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


@functools.cache
def ceilings() -> dict:
    """Measured on this card: copy GB/s and bf16 matmul TFLOP/s."""
    src = torch.randn(2**29 // 2, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    copy_ms = median_ms(lambda: src.clone())
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: a @ b)
    return {
        "card": torch.cuda.get_device_name(),
        "copy_GBps": 2 * src.numel() * src.element_size() / copy_ms / 1e6,
        "bf16_TFLOPs": 2 * 8192**3 / mm_ms / 1e9,
    }


@functools.cache
def same_size_copy_ms(bytes_moved: float, graph: bool) -> float:
    """A clone that reads and writes bytes_moved in all, timed like the row it is set against: small
    tensors do not reach the large-copy rate (launch, ramp-up and tail are a larger share)."""
    src = torch.empty(max(1, round(bytes_moved / 4)), device="cuda", dtype=torch.bfloat16)
    return (graph_ms if graph else median_ms)(lambda: src.clone())


def report(
    name: str,
    ms: float,
    *,
    bytes_moved: float = 0.0,
    flops: float = 0.0,
    baselines: dict | None = None,
    graph: bool = False,
):
    """Print one row: time, GB/s or TFLOP/s, the ratio to the ceiling (and, for bytes, to a clone of the
    same size, timed the same way: graph says the row is a CUDA-graph replay), speed-ups over baselines."""
    c = ceilings()
    parts = [f"{name:<42} {ms * 1e3:9.1f} us"]
    if bytes_moved:
        gbps = bytes_moved / ms / 1e6
        same = same_size_copy_ms(bytes_moved, graph) / ms
        parts.append(
            f"{gbps:7.0f} GB/s ({gbps / c['copy_GBps']:4.0%} of copy, {same:4.0%} of a same-size copy)"
        )
    if flops:
        tf = flops / ms / 1e9
        parts.append(f"{tf:6.0f} TFLOP/s ({tf / c['bf16_TFLOPs']:4.0%} of matmul)")
    for base, base_ms in (baselines or {}).items():
        parts.append(f"x{base_ms / ms:5.2f} vs {base}")
    print("  ".join(parts), flush=True)


def header(title: str) -> None:
    c = ceilings()
    ceil = f"copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_TFLOPs']:.0f} TFLOP/s"
    print(f"\n== {title} on {c['card']}: {ceil}")


def graph_ms(fn) -> float:
    """Median time of replaying one call of fn captured in a CUDA graph: the GPU work alone. The
    difference to median_ms(fn) is host overhead (Python, dispatch, autograd, launchers)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture wants warm-up (compiles, autotuning) off the default stream
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def report_fwd_bwd(name: str, fns: dict, args: tuple, *, fwd_bytes: float, bwd_bytes: float) -> None:
    """Rows for the first entry of fns (the op): forward (no_grad) and forward+backward (gradients
    for the args that require grad, against a random output gradient), the other entries (eager
    reference, torch.compile of it, ...) timed on the same args as baselines. Each is timed twice,
    as launched from Python and as a CUDA-graph replay, for ours and the baselines alike, so kernel
    time and host overhead show separately."""
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    op, *others = fns
    dy = torch.randn_like(fns[op](*args))

    def forward(f):
        with torch.no_grad():
            return f(*args)

    for timer, graph in ((median_ms, False), (graph_ms, True)):
        fwd = {k: timer(lambda f=f: forward(f)) for k, f in fns.items()}
        both = {k: timer(lambda f=f: torch.autograd.grad(f(*args), wrt, dy)) for k, f in fns.items()}
        tag = " [graph]" if graph else ""
        base = {k: fwd[k] for k in others}
        report(f"{name} fwd{tag}", fwd[op], bytes_moved=fwd_bytes, baselines=base, graph=graph)
        base = {k: both[k] for k in others}
        report(
            f"{name} fwd+bwd{tag}", both[op], bytes_moved=fwd_bytes + bwd_bytes, baselines=base, graph=graph
        )
