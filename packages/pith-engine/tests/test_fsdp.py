"""FSDP2 as `parallelize` applies it, on two gloo ranks (dp=2; a group of one rank is left unsharded):

- compile: dynamo runs FSDP's hooks eagerly, so a stage method compiled under FSDP breaks its graph only
  at FSDP's hooks (a dense layer's stage 1 not at all: its own hooks sit outside the traced frame; a
  MoE layer's at the router's fp32 unit), never inside the model's code;
- the router computes its logits in fp32 under bf16 autocast with bf16 FSDP all-gathers of the rest
  (on CUDA, one GPU: under CUDA's autocast, with no FSDP over the one rank);
- one reduction per step (FSDP2's set_requires_gradient_sync): over two micro-batches each FSDP unit
  reduces its gradient once, and the gradient is
  the one of reducing after every micro-batch.
"""

import collections
import sys
from pathlib import Path

import pith_models
import pytest
import torch
import torch.distributed as dist
from pith_engine import executor, parallel
from pith_engine.fp8 import GatheredFP8, gather_in_fp8, use_fp8
from pith_engine.layers import Linear
from pith_models import qwen3_moe
from pith_models.qwen3_moe import Experts
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.profiler import profile

REDUCE = "FSDP::post_backward_reduce ("  # FSDP's range around one unit's gradient reduction


def _graph_breaks_only_at_fsdp_hooks(model: torch.nn.Module) -> None:
    ids_BS = torch.randint(0, 100, (2, 8))
    h_BSD = model.prologue(ids_BS).detach().requires_grad_()
    pos = model.positions(torch.arange(8).expand(2, 8))
    for i, layer in model.layers.items():
        e = torch._dynamo.explain(layer.stage1)(h_BSD, pos)
        where = [str(b.user_stack[-1].filename) for b in e.break_reasons]
        assert all("/fsdp/" in w for w in where), (i, where)
        assert e.graph_count == e.graph_break_count + 1, (i, e.graph_count, e.graph_break_count)
        # at the router unit's hooks (3 while router_logits held the autocast context around its call)
        assert e.graph_break_count == (0 if layer.router is None else 2), (i, where)


def _router_logits_are_fp32(mesh: parallel.Mesh) -> None:
    dev = mesh.device
    model = pith_models.build(qwen3_moe.TINY, dev, 0, mesh, torch.bfloat16)
    layer = model.layers["1"]
    h_BSD = torch.randn(2, 8, 64, device=dev)
    pos = model.positions(torch.arange(8, device=dev).expand(2, 8))
    with torch.autocast(dev.type, torch.bfloat16):
        r = layer.stage1(h_BSD, pos).routing
    assert r.logits_TE.dtype == torch.float32 and r.probs_TE.dtype == torch.float32
    gate_ED = layer.router.weight
    gate_ED = (gate_ED.full_tensor() if isinstance(gate_ED, DTensor) else gate_ED).double()
    expected_TE = r.x_TD.double() @ gate_ED.T  # the rows stage 1 routed, in float64
    # bf16 logits would be off by ~1e-3 relative; fp32 ones by ~1e-6.
    torch.testing.assert_close(r.logits_TE.double(), expected_TE, rtol=1e-5, atol=1e-6)


def _reductions(model: torch.nn.Module, mesh: parallel.Mesh, sync_each: bool):
    comm = parallel.expert_comm(mesh)
    g = torch.Generator().manual_seed(1)
    with profile() as prof:
        for j in range(2):
            last = sync_each or j == 1  # FSDP2's own switches, as the step executor sets them per unit
            model.set_requires_gradient_sync(last)
            model.set_is_last_backward(last)
            h_BSD, _ = executor.forward(model, torch.randint(0, 100, (2, 8), generator=g), comm)
            (h_BSD.float() ** 2).mean().backward()
    counts = collections.Counter(e.name for e in prof.events() if e.name.startswith(REDUCE))
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return counts, grads


class _ProjectionAndExperts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.experts = Linear(256, 512, bias=False), Experts(4, 256, 128)

    def forward(self, x_ND, ends_E):
        return self.proj(x_ND), self.experts(x_ND, ends_E)


def _fp8_all_gather_on_one_gpu(dev: torch.device) -> None:
    """gather_in_fp8's CUDA path, under FSDP over a one-rank mesh (which parallelize leaves plain, and
    the only FSDP one GPU has): the Triton copies of the gathered e4m3 weight, FSDP freeing them after
    the forward (the modules are not the root) and refilling them for the backward's input gradients,
    and the next step's gathers rewriting them in place with new scales (the weights tripled in
    between). A projection's and an experts module's outputs and gradients over the two steps are bit
    for bit those of the same modules gathering their fp32 weights, which are seen to get GatheredFP8
    weights."""
    mesh1 = init_device_mesh("cuda", (1,))
    g = torch.Generator(dev).manual_seed(0)
    xs = [torch.randn(512, 256, device=dev, generator=g).bfloat16() for _ in range(2)]
    ends_E = torch.tensor([64, 192, 192, 448], device=dev, dtype=torch.int32)  # an empty expert, padding
    runs, seen = [], []
    for gathered in (False, True):
        torch.manual_seed(0)
        model = _ProjectionAndExperts()
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.05)
        model.to(dev)
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for m in (model.proj, model.experts, model):
            fully_shard(m, mesh=mesh1, mp_policy=fp32)
        use_fp8(model)
        if gathered:
            gather_in_fp8(model)
        for m in (model.proj, model.experts):  # the weights each forward sees (FSDP's unsharded ones)
            m.register_forward_pre_hook(lambda m, _: seen.append(type(next(m.parameters()))))
        got = []
        for x in xs:
            x = x.clone().requires_grad_()
            y, z = model(x, ends_E)
            ((y.float() ** 2).mean() + (z.float() ** 2).mean()).backward()
            got += [y, z, x.grad, *(p.grad.full_tensor().clone() for p in model.parameters())]
            model.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(3)
        runs.append(got)
    assert [t is GatheredFP8 for t in seen] == [False] * 4 + [True] * 4, seen
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def _fp8_all_gather_refusals(world: int) -> None:
    """gather_in_fp8 names the weight it cannot gather in e4m3 and why, before any compute: one shared
    with a module that does not quantise it (a tied embedding), one FSDP shards unevenly."""
    mesh = init_device_mesh("cpu", (world,))
    tied = torch.nn.Sequential(torch.nn.Embedding(16, 16), Linear(16, 16, bias=False))
    tied[0].weight = tied[1].weight
    uneven = Experts(world + 1, 16, 16)
    whys = (r"1\.weight \(16, 16\) is shared", f"does not shard evenly over {world} ranks")
    for model, why in zip((tied, uneven), whys, strict=True):
        fully_shard(model, mesh=mesh)
        use_fp8(model)
        with pytest.raises(ValueError, match=why):
            gather_in_fp8(model)


def _worker(world: int, rank: int, tmp: Path, device: str) -> None:
    torch.manual_seed(0)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    mesh = parallel.build_mesh(parallel.Layout(dp=world), dev)
    if device == "cuda":
        _router_logits_are_fp32(mesh)
        _fp8_all_gather_on_one_gpu(dev)
        dist.destroy_process_group()
        return
    _fp8_all_gather_refusals(world)
    model = pith_models.build(qwen3_moe.TINY, "cpu", 0, mesh)
    _graph_breaks_only_at_fsdp_hooks(model)
    _router_logits_are_fp32(mesh)
    once, grads_once = _reductions(model, mesh, sync_each=False)
    each, grads_each = _reductions(model, mesh, sync_each=True)
    units = {"layers.0", "layers.1", "layers.1.mlp.gate", "layers.1.mlp.experts"}
    assert {k.removeprefix(REDUCE).rstrip(")") for k in once} >= units, once
    assert all(once[k] == 1 and each[k] == 2 for k in once), (once, each)
    assert len(grads_once) == len(grads_each) == len(list(model.parameters())) - 1  # all but lm_head
    for n, g in grads_once.items():
        torch.testing.assert_close(g, grads_each[n], rtol=1e-6, atol=1e-8, msg=n)
    dist.destroy_process_group()


@pytest.mark.distributed
def test_fsdp_compiles_between_its_hooks_routes_in_fp32_and_reduces_once_per_step(run_ranks, tmp_path):
    run_ranks(__file__, 2, tmp_path, "cpu")


@pytest.mark.gpu
def test_router_logits_are_fp32_and_fp8_all_gather_exact_on_cuda(run_ranks, tmp_path):
    run_ranks(__file__, 1, tmp_path, "cuda")


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
