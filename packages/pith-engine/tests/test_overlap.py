"""The overlapped forward+backward pairs and the weight-gradient delay change nothing but the order of
work: through the engine's train_step (tiny DeepSeek-V2 in fp32: a dense first layer, shared experts,
8 routed experts; aux losses, clipping and the bias update on), overlap on/off x weight-gradient delay
on/off (both on and both off under the pipelines) give the same per-step losses over 4 AdamW steps,
equal to one process's (relative 1e-5), and every parameter's gradient after the first step, under
pp1 x ep2 (the pp=1 schedule of overlapped pairs), pp2 x ep2 and pp2 x dp2 (DualPipeV; FSDP reduced
once per step, after the last weight work).
Under pp=1, where every pair's order of gradient accumulation is the plain one, bit for bit.

And the interleave of one overlapped pair under ep2 is the documented one (pith-engine README): each
all-to-all of one micro-batch is in flight while the other runs a compute stage.

Each world size is spawned once (this file run as a script, one process per rank).
"""

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pith_engine.parallel import Layout, Mesh, build_mesh, held_layers, parallelize
from pith_engine.step import Stages, train_step

# (overlap, wgrad delay): all four under pp1 x ep2, both on and both off under the pipelines.
BOTH = [(True, True), (False, False)]
VARIANTS = {2: [*BOTH, (True, False), (False, True)], 4: BOTH}
LAYOUTS = {2: [Layout(ep=2)], 4: [Layout(pp=2, ep=2), Layout(pp=2, dp=2)]}

# One overlapped pair under pp1 x ep2 (F: micro-batch 1's forward, B: micro-batch 0's backward), from
# the pair's start to the end of the backward of the last MoE layer: "|" marks an all-to-all issued
# (the side yields), ">" its wait. Pieces: Stages functions (stage1, send_layout, receive, ...), the
# backward of a piece named as its forward.
DOCUMENTED = (
    "F: prologue stage1 stage1 |"  # layer 0 (dense) whole, layer 1's router; its counts' exchange
    " B: loss layer_aux stage5 |"  # the loss, the last layer's aux and stage 5; combine's reverse
    " F: > send_layout |"  # the host sync (counts), dispatch's exchange
    " B: > moe_unpermute stage3 receive |"  # dispatch's reverse
    " F: > receive stage3 moe_unpermute |"  # combine's exchange
    " B: > send_layout stage1"  # the last MoE layer's backward done
)


def _documented_trace(trace) -> str:
    """The pair's trace as DOCUMENTED writes it, up to the backward's first stage1."""
    out, side = [], None
    for tag, piece in trace:
        s = tag[0]
        if s != side:
            out.append(f"{s}:")
            side = s
        out.append({"issue": "|", "wait": ">"}.get(piece, piece))
        if s == "B" and piece == "stage1":
            break
    return " ".join(out)


def _in_flight_overlaps(trace) -> None:
    """Every issue of one side is followed by a compute piece of the other before its wait (as long
    as the other side has compute left)."""
    for k, (tag, piece) in enumerate(trace):
        if piece != "issue":
            continue
        end = next((j for j in range(k + 1, len(trace)) if trace[j] == (tag, "wait")), len(trace))
        other = [p for t, p in trace[k:end] if t != tag and p not in ("issue", "wait")]
        left = [p for t, p in trace[k:] if t != tag and p not in ("issue", "wait")]
        assert other or not left, (k, trace[k:end])


def _worker(world: int, rank: int, tmp: Path) -> None:
    from test_pipeline import AUX, BIAS_RATE, MAX_NORM, MODELS, assert_same_losses, compare, train

    torch.set_num_threads(1)
    store = f"file://{tmp}/store{world}"
    timeout = timedelta(minutes=8)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world, timeout=timeout)
    cpu = torch.device("cpu")
    module, config = MODELS["deepseek_v2"]
    refs = {}
    for layout in LAYOUTS[world]:
        cfg, dr = config(2 * layout.pp), layout.data_ranks
        if rank == 0 and (cfg.num_hidden_layers, dr) not in refs:
            refs[(cfg.num_hidden_layers, dr)] = train(module, cfg, Mesh(Layout(), cpu), dr)
        mesh = build_mesh(layout, cpu)
        runs = []
        for overlap, wgrad in VARIANTS[world]:
            losses, grads = train(module, cfg, mesh, dr, overlap=overlap, wgrad=wgrad)
            where = f"{layout} overlap={overlap} wgrad={wgrad}"
            if mesh.dp_rank == mesh.cp_rank == mesh.ep_rank == 0:
                torch.save(grads, tmp / f"grads_{world}_{mesh.pp_rank}.pt")
            dist.barrier()
            if rank == 0:
                compare(losses, refs[(cfg.num_hidden_layers, dr)], tmp, world, layout.pp, where)
                assert_same_losses(losses, runs[0] if runs else losses, f"{where} against both on")
                if layout.pp == 1:
                    assert not runs or losses == runs[0], (where, losses, runs[0])
            runs.append(losses)
            dist.barrier()

    if world == 2:  # the interleave of one overlapped pair, recorded in a step of two micro-batches
        cfg = config(2)
        model = module.Model(cfg)
        module.init_weights(model, seed=0)
        mesh = build_mesh(Layout(ep=2), cpu)
        parallelize(model, mesh)
        stages = Stages(model, mesh)
        stages.trace = []
        g = torch.Generator().manual_seed(rank)
        micro = [(torch.randint(0, cfg.vocab_size, (1, 16), generator=g),) * 2 for _ in range(2)]
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        opt.step = lambda grad_scale=None: None
        moe_layers = sum(layer.experts is not None for layer in held_layers(model).values())
        train_step(stages, opt, micro, 0.0, AUX._replace(moe_layers=moe_layers), MAX_NORM, BIAS_RATE)
        pair = [(t, p) for t, p in stages.trace if t in ("F0.1", "B0.0")]
        assert _documented_trace(pair) == DOCUMENTED, _documented_trace(pair)
        _in_flight_overlaps(pair)
    dist.destroy_process_group()


@pytest.mark.distributed
def test_overlap_and_wgrad_delay_reproduce_one_process_and_the_documented_interleave(run_ranks, tmp_path):
    run_ranks(__file__, 2, tmp_path, timeout=900)  # pp1 x ep2, the pair's interleave
    run_ranks(__file__, 4, tmp_path, timeout=1500)  # pp2 x ep2, pp2 x dp2


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
