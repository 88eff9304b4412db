"""apply_rope at the Qwen3-30B-A3B attention shapes: q [4, 4096, 32, 128], k [4, 4096, 4, 128], full
rotary (R = 64) with fp32 cos/sin [4, 4096, 64] as the models build them; interleaved for q as well.

Bytes: forward reads x, cos, sin and writes the output; backward reads dy, cos, sin and writes dx.
Each row also gives the share of a clone moving the same bytes (harness.report): the floor at this
size, where launch and the wave tail are a visible share (one pass over the k of 4 heads is ~42 MB).
The "tile" rows time the forward kernel alone with 2048-16384 elements per program (the op uses 4096).
Run on a CUDA machine: python3 packages/pith-ops/benchmarks/bench_rope.py
"""

import torch
from harness import graph_ms, header, report, report_fwd_bwd
from pith_ops.rope import _launch, apply_rope, apply_rope_reference

B, S, D, R = 4, 4096, 128, 64


def main() -> None:
    angle = torch.randn(B, S, R, device="cuda") * 100
    cos, sin = angle.cos(), angle.sin()
    for H, interleaved in ((32, False), (4, False), (32, True)):
        header(f"apply_rope on x [{B}, {S}, {H}, {D}] bf16, cos/sin fp32, interleaved={interleaved}")
        x = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fns = {
            "pith": lambda x, c, s, i=interleaved: apply_rope(x, c, s, i),
            "eager": lambda x, c, s, i=interleaved: apply_rope_reference(x, c, s, i),
            "compile": torch.compile(lambda x, c, s, i=interleaved: apply_rope_reference(x, c, s, i)),
        }
        pass_bytes = 2 * x.numel() * x.element_size() + 2 * cos.numel() * cos.element_size()
        report_fwd_bwd(f"apply_rope H={H}", fns, (x, cos, sin), fwd_bytes=pass_bytes, bwd_bytes=pass_bytes)
        xd = x.detach()
        for elems in (2048, 4096, 8192, 16384):
            ms = graph_ms(lambda e=elems, xd=xd, i=interleaved: _launch(xd, cos, sin, i, False, elems=e))
            report(f"apply_rope H={H} fwd [graph] tile {elems}", ms, bytes_moved=pass_bytes, graph=True)


if __name__ == "__main__":
    main()
