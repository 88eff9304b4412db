"""The overlapped pair: the interleave of one MoE layer's forward with another's backward is the
documented one; every exchange of one side is in flight while the other side computes (any step
sequences without back-to-back exchanges); and under ep=2 on gloo, micro-batch 1's forward
overlapped with micro-batch 0's backward (weight gradients deferred to a queue and run after, each
MoE layer's auxiliary loss injected in its stage 1) gives the losses and every gradient of the plain
whole-graph run, bit for bit; so do two pipeline chunks run one after the other.

Run as a script, this file is one rank of the distributed test.
"""

import dataclasses
import sys
from datetime import timedelta
from pathlib import Path

import pith_models
import pith_ops
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from pith_engine import executor
from pith_engine.contract import default_position_ids
from pith_engine.expert_parallel import ExpertParallel
from pith_engine.layers import WeightGradQueue, set_wgrad_queue
from pith_engine.overlap import Phase, interleave
from pith_engine.parallel import Layout, Mesh, parallelize
from pith_models import deepseek_v2

FORWARD = [False, True, False, True, False]  # F1, F2 (dispatch), F3, F4 (combine), F5
BACKWARD = [False, True, False, True, False]  # B5, B4 (combine's backward), B3, B2 (dispatch's), B1
# overlap.py's docstring; a "." ends the issue of an exchange, ">" its wait.
DOCUMENTED = "F1 F2. B5 B4. F2> F3 F4. B4> B3 B2. F4> F5 B2> B1"


def _names(order) -> str:
    names = (["F1", "F2", "F3", "F4", "F5"], ["B5", "B4", "B3", "B2", "B1"])
    mark = {Phase.RUN: "", Phase.ISSUE: ".", Phase.WAIT: ">"}
    return " ".join(names[side][i] + mark[phase] for side, i, phase in order)


def test_one_moe_layer_pair_interleaves_as_documented():
    assert _names(interleave(FORWARD, BACKWARD)) == DOCUMENTED


def _alternating(flags: list[bool]) -> list[bool]:
    """A compute step first and no two exchanges back to back, as a micro-batch's steps are."""
    flags = [False, *flags]
    return [c and not flags[i - 1] for i, c in enumerate(flags)]


@given(
    first=st.lists(st.booleans(), max_size=12).map(_alternating),
    second=st.lists(st.booleans(), max_size=12).map(_alternating),
)
def test_every_exchange_is_in_flight_while_the_other_side_computes(first, second):
    order = interleave(first, second)
    seqs = (first, second)
    for side in (0, 1):  # each step once, in order: compute RUN; exchange ISSUE then WAIT
        phases = lambda comm: (Phase.ISSUE, Phase.WAIT) if comm else (Phase.RUN,)
        want = [(i, p) for i, c in enumerate(seqs[side]) for p in phases(c)]
        assert [(i, p) for s, i, p in order if s == side] == want
    for k, (side, i, phase) in enumerate(order):
        if phase is not Phase.ISSUE:
            continue
        other_computes_left = any(s == 1 - side and p is Phase.RUN for s, _, p in order[k:])
        end = order.index((side, i, Phase.WAIT))
        overlapped = any(s == 1 - side and p is Phase.RUN for s, _, p in order[k:end])
        assert overlapped or not other_computes_left, (order, k)


def _worker(world: int, rank: int, tmp: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    group = dist.group.WORLD
    # Layer 0 dense, layers 1 and 2 MoE (8 experts, 4 per rank): a dense step, then two MoE layers.
    cfg = dataclasses.replace(deepseek_v2.TINY, num_hidden_layers=3)
    g = torch.Generator().manual_seed(5 + rank)  # each EP rank its own sequences
    micro = [torch.randint(0, cfg.vocab_size, (2, 8), generator=g) for _ in range(2)]
    labels = [torch.randint(0, cfg.vocab_size, (2, 8), generator=g) for _ in range(2)]
    mesh = Mesh(Layout(ep=2), torch.device("cpu"), ep_rank=rank, ep_group=group)

    def fresh():
        model = pith_models.build(cfg, "cpu", seed=1)
        return parallelize(model, mesh)  # this rank's experts; no FSDP (no dense mesh)

    def loss_of(model, labels_BS):
        w = model.lm_head.weight
        return lambda h: pith_ops.linear_cross_entropy(h.flatten(0, 1), w, labels_BS.flatten(), -100, "sum")

    def aux_of(r):  # a router z-loss and a probability penalty, per layer
        z = (torch.logsumexp(r.logits_TE.float(), dim=-1) ** 2).mean()
        return 1e-2 * z + 1e-1 * (r.probs_TE**2).sum() / r.probs_TE.shape[0]

    # Plain: each micro-batch's forward and backward through one autograd graph.
    plain, comm = fresh(), ExpertParallel(group)
    plain_losses = []
    for ids, lab in zip(micro, labels):
        h, routings = executor.forward(plain, ids, comm)
        aux = sum(aux_of(r) for r in routings)
        (loss_of(plain, lab)(h) + aux).backward()
        plain_losses.append((loss_of(plain, lab)(h).detach(), aux.detach()))

    # Overlapped: F(0) alone, then F(1) with B(0) as one overlapped pair, then B(1); every backward's
    # weight gradients deferred and run afterwards (the W slots).
    from pith_engine.overlap import MicroBatch, run_overlapped, run_pair

    model = fresh()
    queue = WeightGradQueue()
    set_wgrad_queue(model, queue)
    mbs = [
        MicroBatch(model, comm, ids, model.positions(default_position_ids(ids)), loss_of(model, lab), aux_of)
        for ids, lab in zip(micro, labels)
    ]
    trace = []
    run_pair(mbs[0].forward_steps(), [])
    with queue.deferring():
        run_pair(mbs[1].forward_steps(), mbs[0].backward_steps(), trace)
    assert all(p.grad is None for n, p in model.named_parameters() if "experts" in n)  # deferred
    with queue.deferring():
        run_pair(mbs[1].backward_steps(), [])
    queue.run_all()
    # run_overlapped: the same schedule for any number of micro-batches.
    again = fresh()
    again_queue = WeightGradQueue()
    set_wgrad_queue(again, again_queue)
    mbs_again = [
        MicroBatch(again, comm, ids, again.positions(default_position_ids(ids)), loss_of(again, lab), aux_of)
        for ids, lab in zip(micro, labels)
    ]
    run_overlapped(mbs_again, again_queue)
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)

    # Two pipeline chunks (layers 0-1, layer 2) in a row, the activation and its gradient handed over.
    chunked = fresh()
    chunked_losses = []
    for ids, lab in zip(micro, labels):
        pos = chunked.positions(default_position_ids(ids))
        a = MicroBatch(chunked, comm, ids, pos, None, aux_of, chunk=range(2))
        b = MicroBatch(chunked, comm, ids, pos, loss_of(chunked, lab), aux_of, chunk=range(2, 3))
        run_pair(a.forward_steps(), [])
        b.h = a.h.detach()
        run_pair(b.forward_steps(), [])
        run_pair(b.backward_steps(), [])
        a.dh = b.dh
        run_pair(a.backward_steps(), [])
        chunked_losses.append((b.loss, a.aux + b.aux))
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), ("chunked", name, (p.grad - q.grad).abs().max())
    assert all(torch.equal(x, y) for x, y in zip(sum(plain_losses, ()), sum(chunked_losses, ())))

    for (ce, aux), mb in zip(plain_losses, mbs):
        assert torch.equal(ce, mb.loss) and torch.equal(aux, mb.aux), (ce, aux, mb)
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert q.grad is not None and torch.equal(p.grad, q.grad), (name, (p.grad - q.grad).abs().max())
    # The pair's trace: every exchange of one micro-batch waited only after a compute of the other.
    runs = [i for i, t in enumerate(trace) if t.endswith(" run")]
    for i, t in enumerate(trace):
        if t.endswith(" issue"):
            side = t[0]
            end = trace.index(t.replace(" issue", " wait"), i)
            assert any(trace[k][0] != side for k in runs if i < k < end), (t, trace)
    assert "F2 L1 issue" in trace and "B4 L2 issue" in trace, trace
    dist.destroy_process_group()


@pytest.mark.distributed
def test_overlapped_pair_under_ep2_gives_the_plain_losses_and_gradients_bit_for_bit(run_ranks, tmp_path):
    run_ranks(__file__, 2, tmp_path)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
