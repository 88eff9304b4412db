"""Ring attention and the zigzag layout: the ring, run by 2 and 4 gloo processes, reproduces the
single-process attention_reference on the full sequence (output and grads of q, k, v, sinks).

Each world size starts its ranks once (forked processes) and checks every case; the parent asserts
on the errors the ranks report, so a failure reads like any other test.
"""

import json
import multiprocessing
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_engine.attention import attention, attention_reference
from pith_engine.contract import Positions
from pith_engine.ring_attention import (
    _block_attention,
    ring_attention,
    ring_schedule,
    zigzag_split,
)


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global position ids of the tokens this rank keeps."""
    return zigzag_split(torch.arange(seq_len, device=device), cp_size, cp_rank, 0)


# (name, Hq, Hk, Dqk, Dv, window, sinks, documents): chunks are CHUNK tokens long, so window 6 sees
# chunk pairs two apart only partly (some rows see none of a computed block) and skips pairs further
# apart; documents (positions restarting at each, as data.document_mask): of 1 to 9 tokens in one row,
# spanning chunks and ranks, and two in the other, so some queries see nothing in a visiting block
CASES = [
    ("gqa", 4, 2, 8, 8, None, False, False),
    ("mla", 2, 2, 12, 8, None, False, False),
    ("window", 4, 2, 8, 8, 6, False, False),
    ("sinks", 4, 2, 8, 8, None, True, False),
    ("window_sinks_mqa", 4, 1, 8, 8, 6, True, False),
    ("documents", 4, 2, 8, 8, None, False, True),
    ("documents_window_sinks", 4, 1, 8, 8, 6, True, True),
]
CHUNK = 4
# on CUDA the cases grow (head dims x8, chunks and windows x16) so flex_attention runs, not the fallback
GROW = {"cpu": (1, 1), "cuda": (8, 16)}
# max error over max magnitude, per device and dtype: rounding gives ~1e-16 in fp64 and ~1e-7 in fp32
# (measured: 7e-7 at most), a slip in the ring O(1); on CUDA flex_attention sums in another order
TOL = {"cpu torch.float64": 1e-12, "cpu torch.float32": 2e-6, "cuda torch.float32": 1e-4}
DTYPES = {"cpu": (torch.float64, torch.float32), "cuda": (torch.float32,)}


def _document_positions(lengths: list[int], L: int) -> torch.Tensor:
    """Positions restarting at each document of `lengths` (cycled) over L tokens."""
    out, i = [], 0
    while sum(map(len, out)) < L:
        out.append(torch.arange(lengths[i % len(lengths)]))
        i += 1
    return torch.cat(out)[:L]


def _case_errors(world, rank, group, device, dtype, Hq, Hk, Dqk, Dv, window, sinks, docs) -> dict[str, float]:
    import torch.distributed as dist

    dims, length = GROW[device]
    Dqk, Dv, window = Dqk * dims, Dv * dims, window and window * length
    B, L = 2, 2 * world * CHUNK * length
    g = torch.Generator().manual_seed(1234)
    q, k, v, dout = (
        torch.randn(B, L, h, d, generator=g) for h, d in ((Hq, Dqk), (Hk, Dqk), (Hk, Dv), (Hq, Dv))
    )
    sinks_H = torch.randn(Hq, generator=g) if sinks else None
    q, k, v, dout, sinks_H = (t if t is None else t.to(device, dtype) for t in (q, k, v, dout, sinks_H))
    leaves = [t.requires_grad_() for t in (q, k, v, sinks_H) if t is not None]
    scale = Dqk**-0.5

    pos_full = torch.arange(L, device=device).expand(B, L)
    doc_full = doc_BS = None
    if docs:
        rows = [_document_positions([1, 3, 9, 2, 5], L), _document_positions([L // 2 + 3, L], L)]
        pos_full = torch.stack(rows).to(device)
        doc_full = (pos_full == 0).cumsum(1)
        doc_BS = zigzag_split(doc_full, world, rank)
    ref, _ = attention_reference(
        q, k, v, pos_full, pos_full, scale=scale, window=window, sinks_H=sinks_H,
        docs=(doc_full, doc_full) if docs else None,
    )  # fmt: skip
    ref_grads = torch.autograd.grad(ref, leaves, dout)

    local = [zigzag_split(t.detach(), world, rank).requires_grad_() for t in (q, k, v)]
    local_leaves = local + ([sinks_H.detach().clone().requires_grad_()] if sinks else [])
    pos_BS = (
        zigzag_split(pos_full, world, rank)
        if docs
        else zigzag_positions(L, world, rank, device).expand(B, -1)
    )
    pos = Positions(pos_BS, torch.empty(0), torch.empty(0), group, doc_BS)
    out = attention(*local, pos, scale=scale, window=window, sinks_H=local_leaves[3] if sinks else None)
    grads = list(torch.autograd.grad(out, local_leaves, zigzag_split(dout, world, rank)))
    if sinks:  # each rank holds its tokens' share of the sinks' gradient
        dist.all_reduce(grads[3], group=group)
        ref_grads = [*(zigzag_split(t, world, rank) for t in ref_grads[:3]), ref_grads[3]]
    else:
        ref_grads = [zigzag_split(t, world, rank) for t in ref_grads]
    names = ("out", "dq", "dk", "dv", "dsinks")
    wants = [zigzag_split(ref, world, rank), *ref_grads]
    return {
        n: ((got - want).abs().max() / want.abs().max()).item()
        for n, got, want in zip(names, [out, *grads], wants)
    }


def _worker(world: int, rank: int, tmp: Path, device: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # as DataLoader workers do after fork; the ranks share the cores anyway
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "gloo" if device == "cpu" else "nccl",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    group = dist.group.WORLD
    results = {
        f"{device} {dtype}": {
            name: _case_errors(world, rank, group, device, dtype, *spec) for name, *spec in CASES
        }
        for dtype in DTYPES[device]
    }
    (tmp / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _check_results(world: int, tmp: Path, device: str) -> None:
    for rank in range(world):
        results = json.loads((tmp / f"rank{rank}.json").read_text())
        assert set(results) == {f"{device} {dtype}" for dtype in DTYPES[device]}
        for where, cases in results.items():
            assert set(cases) == {c[0] for c in CASES}
            for case, errors in cases.items():
                bad = {q: e for q, e in errors.items() if not e <= TOL[where]}
                assert not bad, f"world {world} rank {rank} {where} {case}: errors above {TOL[where]}: {bad}"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_single_process_reference(world, tmp_path):
    # fork, not spawn: the children inherit the imported torch (a fresh import costs seconds each),
    # and what autograd.grad imports lazily on its first call (sympy, seconds more), done here once
    x = torch.ones(1, requires_grad=True)
    torch.autograd.grad(x * 2, x, torch.ones(1))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(world, rank, tmp_path, "cpu")) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world, "a rank failed (traceback in stderr)"
    _check_results(world, tmp_path, "cpu")


@pytest.mark.gpu
def test_ring_attention_over_nccl_matches_single_process_reference(run_ranks, tmp_path):
    """The same cases, grown, on 2 GPUs: nccl send/recv and the flex_attention block kernel."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    run_ranks(__file__, 2, tmp_path, "cuda")
    _check_results(2, tmp_path, "cuda")


@given(cp=st.integers(1, 5), chunk=st.integers(1, 4), lead=st.integers(1, 3))
def test_zigzag_split_keeps_chunks_r_and_mirror(cp, chunk, lead):
    L = 2 * cp * chunk
    t = torch.randn(lead, L, 3)
    parts = [zigzag_split(t, cp, r, dim=1) for r in range(cp)]
    chunks = t.chunk(2 * cp, 1)
    for r, part in enumerate(parts):
        assert torch.equal(part, torch.cat([chunks[r], chunks[2 * cp - 1 - r]], 1))
        assert torch.equal(zigzag_positions(L, cp, r), zigzag_split(torch.arange(L), cp, r, dim=0))


@given(cp=st.integers(1, 6), chunk=st.integers(1, 5))
def test_zigzag_positions_partition_the_sequence_with_equal_causal_work(cp, chunk):
    L = 2 * cp * chunk
    pos = [zigzag_positions(L, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(pos).sort().values, torch.arange(L))
    # a query at position p attends p + 1 keys: every rank does the same causal work
    assert len({int((p + 1).sum()) for p in pos}) == 1


@given(cp=st.integers(1, 5), chunk=st.integers(1, 4), window=st.none() | st.integers(1, 20))
def test_ring_schedule_computes_exactly_the_chunk_pairs_with_a_visible_key(cp, chunk, window):
    L = 2 * cp * chunk
    work = []
    for rank in range(cp):
        q_pos = zigzag_positions(L, cp, rank)
        steps = ring_schedule(cp, rank, chunk, window)
        assert len(steps) == cp
        work.append(sum(chunk * (ks.stop - ks.start) for pairs in steps for _, ks in pairs))
        for s, pairs in enumerate(steps):
            k_pos = zigzag_positions(L, cp, (rank - s) % cp)
            computed = {(i, j) for i, ks in pairs for j in range(ks.start // chunk, ks.stop // chunk)}
            for i in range(2):
                for j in range(2):
                    d = q_pos[i * chunk : (i + 1) * chunk, None] - k_pos[None, j * chunk : (j + 1) * chunk]
                    seen = (d >= 0) & (d < window) if window is not None else d >= 0
                    assert ((i, j) in computed) == bool(seen.any()), (rank, s, i, j)
    if window is None:  # the zigzag balances the (unwindowed) causal work across ranks
        assert len(set(work)) == 1


@pytest.mark.parametrize("L, cp", [(10, 2), (12, 4), (7, 1)])
def test_zigzag_rejects_a_sequence_not_divisible_by_twice_cp(L, cp):
    with pytest.raises(ValueError, match=f"{L} is not divisible by 2\\*cp = {2 * cp}"):
        zigzag_positions(L, cp, 0)
    with pytest.raises(ValueError, match=f"{L} is not divisible by 2\\*cp = {2 * cp}"):
        zigzag_split(torch.zeros(1, L), cp, 0)


def test_zigzag_rejects_a_rank_outside_the_group():
    with pytest.raises(ValueError, match="cp_rank=2"):
        zigzag_split(torch.zeros(1, 8), 2, 2)


def test_ring_attention_rejects_bad_shapes_before_any_communication():
    q, k, v = torch.zeros(1, 6, 4, 8), torch.zeros(1, 6, 2, 8), torch.zeros(1, 6, 2, 8)
    pos = Positions(torch.zeros(1, 6, dtype=torch.long), torch.empty(0), torch.empty(0), None)
    odd = Positions(torch.zeros(1, 5, dtype=torch.long), torch.empty(0), torch.empty(0), None)
    with pytest.raises(ValueError, match="even local sequence length.*got 5"):
        ring_attention(q[:, :5], k[:, :5], v[:, :5], odd, scale=1.0)
    with pytest.raises(ValueError, match="Hq a multiple of Hk"):
        ring_attention(q[:, :, :3], k, v, pos, scale=1.0)
    with pytest.raises(ValueError, match="position ids"):
        ring_attention(q, k, v, odd, scale=1.0)
    with pytest.raises(ValueError, match="window of at least 1, got 0"):
        ring_attention(q, k, v, pos, scale=1.0, window=0)
    with pytest.raises(ValueError, match="sinks of shape \\[4\\]"):
        ring_attention(q, k, v, pos, scale=1.0, sinks_H=torch.zeros(2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_ring_attention_flex_path_matches_reference_on_cuda(dtype, tol, tmp_path):
    """One-rank ring on CUDA: the flex_attention block kernel (forward and the lse-weighted
    backward) against the fp32 reference, for GQA, MLA-like head dims, a window and sinks."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for Hq, Hk, Dqk, Dv, window, sinks in [(8, 2, 64, 64, None, False), (4, 4, 192, 128, None, False),
                                                (8, 1, 64, 64, 100, True)]:  # fmt: skip
            g = torch.Generator(device="cuda").manual_seed(0)
            B, L = 2, 512
            shapes = ((B, L, Hq, Dqk), (B, L, Hk, Dqk), (B, L, Hk, Dv))
            q, k, v = (torch.randn(s, generator=g, device="cuda", dtype=dtype) for s in shapes)
            sinks_H = torch.randn(Hq, generator=g, device="cuda") if sinks else None
            dout = torch.randn(B, L, Hq, Dv, generator=g, device="cuda", dtype=dtype)
            leaves = [t.requires_grad_() for t in (q, k, v, sinks_H) if t is not None]
            pos_BS = torch.arange(L, device="cuda").expand(B, L)
            q32, k32, v32 = (t.float() for t in (q, k, v))
            ref, _ = attention_reference(
                q32, k32, v32, pos_BS, pos_BS, scale=Dqk**-0.5, window=window, sinks_H=sinks_H
            )
            ref_grads = torch.autograd.grad(ref, leaves, dout.float())
            pos = Positions(pos_BS, torch.empty(0), torch.empty(0), dist.group.WORLD)
            out = ring_attention(q, k, v, pos, scale=Dqk**-0.5, window=window, sinks_H=sinks_H)
            grads = torch.autograd.grad(out, leaves, dout)
            for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref, *ref_grads)):
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                assert err <= tol, f"{dtype} {(Hq, Hk, Dqk, Dv, window, sinks)} {name}: rel error {err}"
            # the block kernel's lse itself, for late queries over every key (what the merge weighs by)
            late = slice(L // 2, L)
            block = (q[:, late], k, v, pos_BS[:, late], pos_BS)
            _, lse = _block_attention(*block, *(torch.zeros_like(p) for p in block[3:]), Dqk**-0.5, window)
            _, ref_lse = attention_reference(
                *(t.detach().float() for t in block[:3]), *block[3:], scale=Dqk**-0.5, window=window
            )
            assert ((lse - ref_lse).abs().max() / ref_lse.abs().max()).item() <= tol
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # one rank of the multi-GPU test (run_ranks starts `python this_file ...`)
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
