"""Expert-parallel dispatch/combine over 2 gloo processes reproduce the local stages 2-5 computed in
float64: the layer output and the gradients of x, of the routing weights and of the experts' weights;
a token is sent once per destination rank, not once per expert; rows for FP8 experts go as e4m3
bytes and scales. (EP over 4 ranks is exercised end to end by test_equivalence.py's ep4 and dp2 x
ep2 layouts.)

Run as a script, this file is one rank of that test.
"""

import sys
from datetime import timedelta
from pathlib import Path

import pith_ops
import pytest
import torch
import torch.distributed as dist
from pith_engine.contract import Routing
from pith_engine.executor import drain
from pith_engine.expert_parallel import ExpertParallel

D = 8
# (name, experts, top-k, tokens on rank r, align, routing): "skewed" sends every token to the first
# EP rank's experts, so the other ranks receive nothing and send back nothing.
CASES = [
    ("top2", 8, 2, lambda r: 5 + r, 1, "random"),
    ("top3_align4", 8, 3, lambda r: 4, 4, "random"),
    ("every_expert", 4, 4, lambda r: 3, 1, "random"),
    ("one_token", 8, 2, lambda r: 1, 1, "random"),
    ("skewed", 8, 2, lambda r: 6, 2, "skewed"),
]


def _routing(E: int, K: int, T: int, kind: str, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    pool = 2 if kind == "skewed" else E  # skewed: only experts 0 and 1
    ids = torch.stack([torch.randperm(pool, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    return x, ids.long(), w


def _check_case(group, E: int, K: int, tokens, align: int, kind: str) -> None:
    R, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(7)
    w_EDD = torch.randn(E, D, D, generator=g, dtype=torch.float64) / D**0.5  # same on every rank
    data = [_routing(E, K, tokens(q), kind, g) for q in range(R)]
    x64, ids, wt64 = data[r]
    dout64 = torch.randn(x64.shape, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)

    # float64 reference, every expert local: out[t] = sum_k w[t, k] * x[t] @ W[ids[t, k]].
    leaves64 = [t.clone().requires_grad_() for t in (x64, wt64, w_EDD)]
    ref = torch.einsum("tk,td,tkde->te", leaves64[1], leaves64[0], leaves64[2][ids])
    ref_grads = torch.autograd.grad(ref, leaves64, dout64)
    dw_experts_sum = ref_grads[2].clone()
    dist.all_reduce(dw_experts_sum, group=group)  # an expert's gradient sums every rank's tokens

    El = E // R
    held = slice(r * El, (r + 1) * El)
    leaves = [t.float().requires_grad_() for t in (x64, wt64, w_EDD[held])]
    comm = ExpertParallel(group, align)
    probs = torch.zeros(ids.shape[0], E)  # only its width (E) matters to dispatch
    x_ND, ends, handle = drain(comm.dispatch(Routing(leaves[0], ids, leaves[1], probs, probs)))
    rows, slots, weights = drain(comm.combine(pith_ops.grouped_gemm(x_ND, leaves[2], ends), handle))
    out = pith_ops.moe_unpermute(rows, slots, weights)
    grads = torch.autograd.grad(out, leaves, dout64.float(), retain_graph=True)

    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    torch.testing.assert_close(grads[0].double(), ref_grads[0], **tol)
    torch.testing.assert_close(grads[1].double(), ref_grads[1], **tol)
    torch.testing.assert_close(grads[2].double(), dw_experts_sum[held], **tol)
    # Deduplicated: one row per (token, destination rank holding any of its experts).
    destinations = {(t, int(e) // El) for t in range(ids.shape[0]) for e in ids[t]}
    assert sum(handle.send_rows) == len(destinations), (handle.send_rows, len(destinations))

    # FP8 experts: the rows go as e4m3 bytes and scales, quantised per token on the source, i.e. the
    # received rows quantised; the stand-in sends nothing and takes the rows' gradient back.
    routing = Routing(leaves[0], ids, leaves[1], probs, probs)
    rows8, ends8, _ = drain(comm.dispatch(routing, fp8=True))
    assert torch.equal(ends8, ends) and not any(rows8.x.stride()) and rows8.x.shape == x_ND.shape
    q, scale = pith_ops.quantize_rows(x_ND.detach())
    assert torch.equal(rows8.q.float() * rows8.scale[:, None], q.float() * scale[:, None])
    dx_ND = torch.randn(x_ND.shape, generator=g)
    want, got = (torch.autograd.grad(rows, leaves[0], dx_ND)[0] for rows in (x_ND, rows8.x))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _worker(world: int, rank: int, tmp: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    for name, *spec in CASES:
        try:
            _check_case(dist.group.WORLD, *spec)
        except AssertionError as e:
            raise AssertionError(f"case {name} rank {rank}: {e}") from None
    try:
        probs = torch.zeros(1, 5)
        routing = Routing(torch.zeros(1, D), torch.zeros(1, 1, dtype=torch.long), probs, probs, probs)
        drain(ExpertParallel(dist.group.WORLD).dispatch(routing))
        raise AssertionError("5 experts over ep=2 was accepted")
    except ValueError as e:
        assert "5 experts" in str(e) and "ep=2" in str(e), e
    dist.destroy_process_group()


@pytest.mark.distributed
def test_expert_parallel_dispatch_combine_match_local_experts_in_float64(run_ranks, tmp_path):
    run_ranks(__file__, 2, tmp_path)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))


@pytest.mark.gpu
def test_expert_parallel_on_cuda_matches_local_experts_with_one_host_sync_per_layer(tmp_path, monkeypatch):
    """One nccl rank (every expert local to it), bf16 rows: the same output and gradients as
    LocalExperts; per layer the host waits exactly once (dispatch's split sizes), on an event of the
    exchange's side stream (executor.Pending.host), and never for a stream or the device."""
    import warnings

    from pith_engine.executor import LocalExperts

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        g = torch.Generator("cuda").manual_seed(0)
        T, E, K = 512, 16, 4
        x = torch.randn(T, 64, device="cuda", generator=g, dtype=torch.bfloat16)
        ids = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
        wt = torch.rand(T, K, device="cuda", generator=g)
        w_EDD = torch.randn(E, 64, 64, device="cuda", generator=g, dtype=torch.bfloat16) / 8
        dout = torch.randn(T, 64, device="cuda", generator=g, dtype=torch.bfloat16)
        probs = torch.zeros(T, E, device="cuda")

        def run(comm):
            leaves = [t.clone().requires_grad_() for t in (x, wt, w_EDD)]
            x_ND, ends, handle = drain(comm.dispatch(Routing(leaves[0], ids, leaves[1], probs, probs)))
            rows, slots, weights = drain(comm.combine(pith_ops.grouped_gemm(x_ND, leaves[2], ends), handle))
            out = pith_ops.moe_unpermute(rows, slots, weights)
            return [out, *torch.autograd.grad(out, leaves, dout)]

        def run_counting_syncs(comm):
            torch.cuda.synchronize()
            waits = []
            event_sync = torch.cuda.Event.synchronize
            monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda e: waits.append(1) or event_sync(e))
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = run(comm)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                monkeypatch.undo()
            return (
                out,
                [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)],
                len(waits),
            )

        comms = LocalExperts(align=8), ExpertParallel(dist.group.WORLD, align=8)
        for comm in comms:  # warm-up: the first nccl call creates the communicator (a sync of its own)
            run(comm)
        (expected, local_syncs, local_waits), (got, ep_syncs, ep_waits) = (
            run_counting_syncs(c) for c in comms
        )
        assert ep_syncs == local_syncs, (ep_syncs, local_syncs)  # nothing waits for the compute stream
        assert (local_waits, ep_waits) == (0, 1)  # the split sizes, on the exchange's event
        for a, b in zip(got, expected):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    finally:
        dist.destroy_process_group()
