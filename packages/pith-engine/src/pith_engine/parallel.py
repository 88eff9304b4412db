"""The device mesh, the layout checks, FSDP2 wrapping and the few collectives a training step needs.

FSDP2 shards expert weights over dp x cp and every other weight over dp x cp x ep, gradients SUMMED.
The design, the module calls FSDP's hooks run on, and the measurements: pith-engine README,
"Parallelism".

Shape legend: E experts, El experts per EP rank.
"""

import os
import warnings
from dataclasses import dataclass

import pith_ops
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from pith_engine import schedule
from pith_engine.executor import ExpertComm, LocalExperts
from pith_engine.expert_parallel import ExpertParallel


@dataclass(frozen=True)
class Layout:
    pp: int = 1  # DualPipeV: 2 chunks of layers each
    dp: int = 1  # FSDP
    cp: int = 1  # share sequences, split them along time
    ep: int = 1  # take different sequences, hold different experts

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.ep

    @property
    def data_ranks(self) -> int:
        return self.dp * self.ep


def check_layout(
    layout: Layout, *, world_size: int, num_experts: int, seq_len: int, global_batch: int, micro_batch: int
) -> None:
    p = layout
    problems = [f"{k}={v} must be >= 1" for k, v in vars(p).items() if v < 1]
    if problems:
        raise ValueError("parallel layout: " + "; ".join(problems))
    if world_size != p.world:
        problems.append(f"world size {world_size} != pp*dp*cp*ep = {p.pp}*{p.dp}*{p.cp}*{p.ep} = {p.world}")
    if num_experts % p.ep:
        problems.append(f"{num_experts} experts do not divide over ep={p.ep} ranks")
    if p.cp > 1 and seq_len % (2 * p.cp):
        problems.append(f"sequence length {seq_len} is not divisible by 2*cp = {2 * p.cp} (zigzag chunks)")
    if global_batch % (micro_batch * p.data_ranks):
        problems.append(
            f"global batch {global_batch} is not divisible by micro_batch*dp*ep = "
            f"{micro_batch}*{p.dp}*{p.ep} = {micro_batch * p.data_ranks}"
        )
    if problems:
        raise ValueError("parallel layout: " + "; ".join(problems))


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the layout and the groups it talks over (None: a single process)."""

    layout: Layout
    device: torch.device
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    ep_rank: int = 0
    pp_group: ProcessGroup | None = None  # pipeline neighbours (P2P) and sums over the pipeline ranks
    cp_group: ProcessGroup | None = None  # ring attention
    ep_group: ProcessGroup | None = None  # expert all-to-alls
    reduce_group: ProcessGroup | None = None  # dp x cp x ep: losses, token and expert-load counts, norms
    dense_mesh: DeviceMesh | None = None  # FSDP mesh of non-expert weights (dp x cp x ep)
    expert_mesh: DeviceMesh | None = None  # FSDP mesh of expert weights (dp x cp)

    @property
    def data_rank(self) -> int:
        """Which of the dp*ep data shards this rank reads."""
        return self.dp_rank * self.layout.ep + self.ep_rank


SINGLE = Mesh(Layout(), torch.device("cpu"))  # a single process: no groups


def build_mesh(layout: Layout, device: torch.device) -> Mesh:
    """Starts the process group from torchrun's env if needed; without torchrun one process needs none."""
    if layout.world == 1 and not dist.is_initialized() and "RANK" not in os.environ:
        return Mesh(layout, device)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != layout.world:
        raise ValueError(
            f"parallel layout: world size {dist.get_world_size()} != pp*dp*cp*ep = {layout.world} ({layout})"
        )
    mesh = init_device_mesh(
        device.type, (layout.pp, layout.dp, layout.cp, layout.ep), mesh_dim_names=("pp", "dp", "cp", "ep")
    )
    dense = mesh["dp", "cp", "ep"]._flatten("dp_cp_ep")
    experts = mesh["dp", "cp"]._flatten("dp_cp")
    return Mesh(
        layout, device, **{f"{axis}_rank": mesh.get_local_rank(axis) for axis in ("pp", "dp", "cp", "ep")},
        pp_group=mesh.get_group("pp") if layout.pp > 1 else None,
        cp_group=mesh.get_group("cp") if layout.cp > 1 else None,
        ep_group=mesh.get_group("ep"), reduce_group=dense.get_group(), dense_mesh=dense, expert_mesh=experts,
    )  # fmt: skip


def expert_comm(mesh: Mesh, align: int = 1) -> ExpertComm:
    return ExpertParallel(mesh.ep_group, align) if mesh.layout.ep > 1 else LocalExperts(align)


def held_layers(model: nn.Module) -> dict[int, nn.Module]:
    if isinstance(model.layers, nn.ModuleDict):
        return {int(i): layer for i, layer in model.layers.items()}
    return dict(enumerate(model.layers))


def _expert_modules(model: nn.Module) -> list[nn.Module]:
    return [layer.experts for layer in held_layers(model).values() if layer.experts is not None]


def num_experts(model: nn.Module) -> int:
    """Routed experts per MoE layer of a model that holds them all (0 for a dense model)."""
    return max((p.shape[0] for m in _expert_modules(model) for p in m.parameters()), default=0)


def expert_param_names(model: nn.Module) -> set[str]:
    """Names (as model.named_parameters gives them) of the stacked expert weights [E_held, ...]."""
    ids = {id(p) for m in _expert_modules(model) for p in m.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def parallelize(model: nn.Module, mesh: Mesh, param_dtype: torch.dtype | None = None) -> nn.Module:
    """In place: keep this pipeline rank's layers (the embedding, final norm and lm_head on rank 0
    only) and this EP rank's experts, then FSDP2 (fp32 reduction). Best on the meta device."""
    pp = mesh.layout.pp
    if pp > 1:
        spans = schedule.split_layers(len(held_layers(model)), pp)
        keep = [i for c in schedule.rank_chunks(pp, mesh.pp_rank) for i in spans[c]]
        model.layers = nn.ModuleDict({str(i): layer for i, layer in held_layers(model).items() if i in keep})
        if mesh.pp_rank != 0:
            del model.embed_tokens, model.norm, model.lm_head
    ep, r = mesh.layout.ep, mesh.ep_rank
    for m in _expert_modules(model):
        for name, p in list(m.named_parameters(recurse=False)):
            if p.shape[0] % ep:
                raise ValueError(f"expert weight {name} {tuple(p.shape)}: {p.shape[0]} experts over ep={ep}")
            held = p.shape[0] // ep
            setattr(m, name, nn.Parameter(p.detach()[r * held : (r + 1) * held].clone()))
    # A group of one rank shards nothing; FSDP over it only adds copies (pith-engine README, 87.6%).
    if mesh.dense_mesh is None or mesh.dense_mesh.size() == 1:
        return model
    # FSDP2 warns at every forward of a unit that returned a view (12 lines a step, tiny model):
    # an in-place op on it would drop a hook, but the Tape hands each stage output on detached.
    warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(.*\) returned a view tensor")
    # cast_forward_inputs off: Positions carries fp32 rotary tables that must stay fp32.
    mp = MixedPrecisionPolicy(param_dtype, torch.float32, cast_forward_inputs=False)
    fp32 = MixedPrecisionPolicy(torch.float32, torch.float32, cast_forward_inputs=False)
    layers = list(held_layers(model).values())
    plain = (
        {p for m in _expert_modules(model) for p in m.parameters()} if mesh.expert_mesh.size() == 1 else set()
    )
    for layer in layers:
        if layer.router is not None:
            fully_shard(layer.router, mesh=mesh.dense_mesh, mp_policy=fp32)
        if layer.experts is not None and not plain:
            fully_shard(layer.experts, mesh=mesh.expert_mesh, mp_policy=mp)
        fully_shard(layer, mesh=mesh.dense_mesh, mp_policy=mp, ignored_params=plain)
        register_fsdp_forward_method(layer, "stage1")
    # The root stays unsharded after the epilogue: the loss reads lm_head.weight right after it. An untied
    # embedding is a unit apart, to reduce one gradient dtype (pith-engine README, FSDP under PP).
    unit = dict(mesh=mesh.dense_mesh, mp_policy=mp, reshard_after_forward=False)
    if hasattr(model, "embed_tokens") and model.embed_tokens.weight is not model.lm_head.weight:
        fully_shard(model.embed_tokens, **unit)
    fully_shard(model, **unit, ignored_params=plain)
    register_fsdp_forward_method(model, "prologue")
    register_fsdp_forward_method(model, "epilogue")
    # Explicit forward prefetch: under EP dispatch waits on the host for its split sizes, which would
    # delay the experts' and the next layer's all-gathers; issued at the previous unit's start, they
    # run beside stage 1 (resp. 3-5). Not under PP, where the schedule picks the next unit.
    for layer, after in zip(layers, [*layers[1:], None]) if mesh.layout.pp == 1 else ():
        chain = [m for m in (layer, layer.experts, after) if isinstance(m, FSDPModule)]
        for m, nxt in zip(chain, chain[1:]):
            m.set_modules_to_forward_prefetch([nxt])
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # A plain SUM: gloo has no PREMUL_SUM/AVG, and fp32 reduction needs no pre-scaling.
            m.set_force_sum_reduction_for_comms(True)
    return model


def to_local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_rows(t: Tensor) -> tuple[Tensor, range]:
    """-> (this rank's local tensor of `t`, the rows of dim 0 of t's global tensor it holds: FSDP2's
    torch.chunk pieces; an EP-sliced expert weight's global tensor is this EP rank's experts)."""
    local = to_local(t)
    if not isinstance(t, DTensor):
        return local, range(t.shape[0])
    assert t.placements == (Shard(0),), t.placements
    n, size = t.shape[0], -(-t.shape[0] // t.device_mesh.size())
    first = min(n, t.device_mesh.get_local_rank() * size)
    rows = range(first, min(n, first + size))
    assert len(rows) == local.shape[0], (rows, local.shape)
    return local, rows


def held_experts(t: Tensor, mesh: Mesh) -> list[tuple[int, Tensor]]:
    """(global expert index, view of its [...] tensor) for each expert of stacked `t` on this rank."""
    local, rows = local_rows(t)  # rows of this EP rank's El experts (a DTensor's shape is El over dp x cp)
    first = mesh.ep_rank * t.shape[0]
    return [(first + r, local[j]) for j, r in enumerate(rows)]


def all_reduce_sum(t: Tensor, mesh: Mesh, pp: bool = False) -> Tensor:
    """In place: the sum over all dp x cp x ep ranks (and pp ranks if `pp`)."""
    if mesh.reduce_group is not None:
        dist.all_reduce(t, group=mesh.reduce_group)
    if pp and mesh.pp_group is not None:
        dist.all_reduce(t, group=mesh.pp_group)
    return t


@torch.no_grad()
def grad_norm(params: list[nn.Parameter], mesh: Mesh) -> Tensor:
    """The global gradient norm (fp32), with no host sync: each gradient element lives on one rank."""
    local = [to_local(g) for g in map(pith_ops.grad, params) if g is not None]
    # One fused read of the gradients per dtype (a per-tensor pow/sum loop also writes a temporary the
    # size of each: ~10 ms more a step on the bench's 3B fp32 gradients).
    sq = torch.zeros((), dtype=torch.float32, device=params[0].device)
    if local:
        by_dtype = [[g for g in local if g.dtype == d] for d in dict.fromkeys(g.dtype for g in local)]
        norms = [n for same in by_dtype for n in torch._foreach_norm(same, 2, dtype=sq.dtype)]
        sq += torch.linalg.vector_norm(torch.stack(norms)).pow(2)
    return all_reduce_sum(sq, mesh, pp=True).sqrt()


def clip_coef(norm: Tensor, max_norm: float) -> Tensor:
    """What clipping scales the gradients by: 1 when max_norm <= 0."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm)
