"""One rank's training step: its micro-batches' forward and backward work in the pipeline schedule's
order, each (chunk, micro-batch) forward recorded on an executor.Tape; then the gradient norm, the
optimizer and the expert-bias update. Each data rank back-propagates its share of the global loss, so
gradients are SUMMED over data ranks and every layout trains as one process does. Design and costs:
pith-engine README, "The training step".

Shape legend: B sequences, S sequence length, T = B*S tokens, D hidden, E experts, K top-k, L layers.
"""

import functools
import itertools
import math
from typing import NamedTuple

import pith_ops
import torch
import torch.distributed as dist
from pith_ops.fp8_linear import fp8_linear_weight
from torch import Tensor, nn
from torch.autograd.profiler import record_function
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from pith_engine import parallel
from pith_engine.contract import Routing, default_position_ids
from pith_engine.cuda_graph import StepGraph
from pith_engine.executor import DIRECT, Steps, Tape, drain, interleave, run_layer
from pith_engine.fp8 import FP8Switch
from pith_engine.parallel import held_layers
from pith_engine.ring_attention import zigzag_split
from pith_engine.schedule import (
    P2P,
    Action,
    Op,
    Overlap,
    forward_schedule,
    rank_chunks,
    schedule,
    split_layers,
)
from pith_engine.wgrad import WeightGradQueue, set_wgrad_queue

IGNORE_INDEX = -100


class Stages:
    """This rank's part of the model as the step runs it.

    compile: the non-expert stages (stage 3's group sizes are data-dependent). ac: "selective"
    recomputes stage 3 (its T*K hidden rows of 3F: the largest activations), "full" stages 1, 3 and 5.
    dtype: the residual stream's. align: each expert's row padding (16 for FP8's GEMM). overlap:
    interleave overlapped pairs at their exchanges. wgrad: I actions leave weight gradients to W
    actions (under compile only the eager expert GEMMs defer). Neither changes a result (test_overlap.py).
    """

    class Layer:
        def __init__(self, layer: nn.Module, compiled, ac: str):
            # Checkpoint inside compile: torch.compile traces it and its partitioner does the recompute.
            recompute = lambda fn: lambda *args: torch_checkpoint(fn, *args, use_reentrant=False)
            full = recompute if ac == "full" else lambda fn: fn
            self.module, self.experts = layer, layer.experts
            self.stage1 = compiled(full(layer.stage1))
            self.stage3 = recompute(layer.stage3) if ac != "none" else layer.stage3
            self.stage5 = compiled(full(layer.stage5))

    def __init__(
        self, model: nn.Module, mesh: parallel.Mesh, compile: bool = False, ac: str = "none", dtype=None,
        align: int = 1, overlap: bool = True, wgrad: bool = True, cuda_graph: bool = False,
    ):  # fmt: skip
        if cuda_graph and (mesh.layout.world > 1 or mesh.device.type != "cuda"):
            raise ValueError(
                f"a CUDA graph step runs on one CUDA process, got {mesh.layout.world} process(es) on"
                f" {mesh.device.type}: turn train.cuda_graph off"
            )
        # Off under FSDP alone: dynamo runs its unshard/reshard hooks eagerly, breaking the graph there
        # only (as TorchTitan's per-block compile).
        fullgraph = not isinstance(model, FSDPModule)
        compiled = functools.partial(torch.compile, fullgraph=fullgraph) if compile else lambda fn: fn
        pp = mesh.layout.pp
        held = held_layers(model)
        spans = split_layers(model.cfg.num_hidden_layers, pp)
        self.chunks = {
            c: {i: self.Layer(held[i], compiled, ac) for i in spans[c]} for c in rank_chunks(pp, mesh.pp_rank)
        }
        self.last = len(spans) - 1
        self.model, self.mesh, self.comm = model, mesh, parallel.expert_comm(mesh, align)
        self.dtype = dtype or next(model.parameters()).dtype
        self.biases = {
            i: b for i, layer in held.items() for n, b in layer.named_buffers() if n.endswith("expert_bias")
        }
        # Routed experts per MoE layer (the bias buffers are [E]), the same on every pipeline rank.
        self.num_experts = max((len(b) for b in self.biases.values()), default=0)
        if mesh.pp_group is not None:
            E = torch.tensor(self.num_experts, device=mesh.device)
            dist.all_reduce(E, dist.ReduceOp.MAX, group=mesh.pp_group)
            self.num_experts = int(E)
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.overlap, self.queue = overlap, WeightGradQueue() if wgrad else None
        self.trace: list | None = None  # tests: (tag, stage piece) as they run
        self.graph = StepGraph(_schedule_work) if cuda_graph else None
        set_wgrad_queue(model, self.queue)

        def prologue(ids_BS: Tensor) -> Tensor:
            return model.prologue(ids_BS).to(dtype)

        self.prologue = compiled(prologue)
        self.epilogue = compiled(model.epilogue)
        if pp > 1:  # gathered through the step: 2 bytes per parameter of its chunks in bf16
            for unit in self.units:
                unit.set_reshard_after_forward(False, recurse=False)
                unit.set_reshard_after_backward(False, recurse=False)
        elif isinstance(model, FSDPModule):
            # The root (norm, lm_head) and an untied embedding stay gathered: the loss reads lm_head outside
            # an FSDP call, and in an overlapped pair each backward segment's end would reshard them under
            # the other micro-batch's forward.
            for unit in [m for m in (model, model.embed_tokens) if m in self.units]:
                unit.set_reshard_after_backward(False, recurse=False)


def local_tokens(inputs_BS: Tensor, labels_BS: Tensor, mesh: parallel.Mesh, pos_BS: Tensor | None = None):
    """-> (inputs, labels, position ids, document ids) (None: in order, one document), under CP this
    rank's zigzag share. pos_BS: positions restarting at 0 at each document."""
    cp, r = mesh.layout.cp, mesh.cp_rank
    doc_BS = None if pos_BS is None else (pos_BS == 0).cumsum(1)
    if cp == 1:
        return inputs_BS, labels_BS, pos_BS, doc_BS
    pos_BS = default_position_ids(inputs_BS) if pos_BS is None else pos_BS
    return tuple(t if t is None else zigzag_split(t, cp, r) for t in (inputs_BS, labels_BS, pos_BS, doc_BS))


def loss_sum(h_BSD: Tensor, lm_head: nn.Linear, labels_T: Tensor) -> Tensor:
    """Cross-entropy summed over the label tokens, lm_head fused; in FP8 while an FP8Switch lm_head
    has fp8 set (the contract's may be any nn.Linear)."""
    w = lm_head.weight
    fp8 = isinstance(lm_head, FP8Switch) and lm_head.fp8
    w8 = FP8Switch.fp8_weight(w, fp8_linear_weight) if fp8 else None
    w_VD = (pith_ops.stand_in if fp8 else pith_ops.cast)(w, h_BSD.dtype)  # FP8 reads w8 only
    return pith_ops.linear_cross_entropy(h_BSD.flatten(0, 1), w_VD, labels_T, IGNORE_INDEX, "sum", w8)


class Aux(NamedTuple):
    lbl_coef: float = 0.0  # global-batch load balancing
    z_loss_coef: float = 0.0  # router z-loss
    moe_layers: int = 1  # MoE layers of the whole model: the terms are averaged over them
    micro_batches: int = 1  # ... and over the step's micro-batches


def layer_aux(r: Routing, aux: Aux, tokens: int, mesh: parallel.Mesh) -> tuple[Tensor, Tensor]:
    """This rank's share of one MoE layer's aux losses on one micro-batch, and the layer's expert counts
    [E] over all data ranks. Global-batch load balancing: E * sum_e f_e * P_e, f_e the share of (token,
    k) entries choosing e, P_e e's mean router probability over all `tokens`."""
    E, K = r.probs_TE.shape[1], r.expert_ids_TK.shape[1]
    ids = r.expert_ids_TK.flatten()
    counts_E = torch.zeros(E, device=ids.device).index_add_(0, ids, torch.ones(ids.shape, device=ids.device))
    parallel.all_reduce_sum(counts_E, mesh)
    lbl = z = torch.zeros((), device=counts_E.device)
    if aux.lbl_coef:
        lbl = lbl + E * (counts_E / (tokens * K) * r.probs_TE.sum(0) / tokens).sum()
    if aux.z_loss_coef:
        z = z + (torch.logsumexp(r.logits_TE.float(), dim=-1) ** 2).sum() / tokens
    return (aux.lbl_coef * lbl + aux.z_loss_coef * z) / aux.moe_layers / aux.micro_batches, counts_E


class StepResult(NamedTuple):
    loss: Tensor  # cross-entropy per label token of the global batch
    aux: Tensor  # the auxiliary losses' part of the step loss
    grad_norm: Tensor  # before clipping
    counts_LE: Tensor | None  # expert counts of every layer over the step (zero rows: dense layers)


class _Run:
    def __init__(self, stages: Stages, micro: list, label_tokens, aux: Aux, grad: bool):
        self.stages, self.micro, self.label_tokens, self.aux = stages, micro, label_tokens, aux
        self.grad = grad
        self.data: dict[tuple[Op, int, int], Tensor] = {}  # (F output / B input grad, chunk, micro)
        self.tapes: dict[tuple[int, int], tuple[Tape, Tensor | None, Tensor | None]] = {}
        self.sums = torch.zeros(3, device=stages.mesh.device)  # cross-entropy sum, aux share, label tokens
        self.counts: dict[int, Tensor] = {}  # MoE layer -> expert counts [E]
        # One micro-batch of every data rank: the aux terms' token count.
        self.tokens = micro[0][0].numel() * stages.mesh.layout.data_ranks * stages.mesh.layout.cp

    def run(self, actions: list) -> None:
        for transfers, items in itertools.groupby(actions, lambda a: isinstance(a, P2P)):
            if transfers:  # consecutive transfers: one batch
                self.transfer(list(items))
                continue
            for item in items:
                if isinstance(item, Overlap) and self.stages.overlap:
                    f, b = item
                    tags = (f"F{f.chunk}.{f.micro}", f"B{b.chunk}.{b.micro}")
                    interleave(self.steps(f), self.steps(b), self.stages.trace, tags)
                else:
                    for a in item if isinstance(item, Overlap) else (item,):
                        drain(self.steps(a))

    def steps(self, a: Action) -> Steps:
        queue = self.stages.queue
        if a.op is Op.F:
            # autocast each run of compute, not across the yields (the other side may be a backward)
            cuda = self.stages.mesh.device.type == "cuda"
            forward = self.forward(a)
            while True:
                with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
                    try:
                        next(forward)
                    except StopIteration:
                        return
                yield
        elif a.op is Op.W:
            if queue is not None:
                queue.run_next()
        elif a.op is Op.B or queue is None:
            yield from self.backward(a)
        else:  # I: weight gradients queued for a later W. A unit's last backward of the step reduces
            # its gradients under FSDP: then the queue runs first, nothing deferred.
            final = self.tapes[(a.chunk, a.micro)][0].final and bool(self.stages.units)
            if final:
                queue.run_all()
            with queue.deferring(enabled=not final):
                yield from self.backward(a)

    def forward(self, a: Action) -> Steps:
        s, (ids_BS, labels_BS, pos_BS, doc_BS) = self.stages, self.micro[a.micro]
        mesh = s.mesh
        tape = Tape(a.micro == len(self.micro) - 1, s.trace, f"F{a.chunk}.{a.micro}") if self.grad else None
        seg = tape or DIRECT
        pos = s.model.positions(default_position_ids(ids_BS) if pos_BS is None else pos_BS, mesh.cp_group)
        pos = pos._replace(doc_BS=doc_BS)
        h_in = None
        if a.chunk == 0:
            h = seg(s.prologue, ids_BS, owner=s.model)
        else:
            h = h_in = self.data.pop((Op.F, a.chunk - 1, a.micro)).requires_grad_(self.grad)
        for i, layer in s.chunks[a.chunk].items():
            h, r = yield from run_layer(layer, h, pos, s.comm, seg, layer.module)
            if r is not None and tape:
                share, counts_E = seg(layer_aux, r, self.aux, self.tokens, mesh)
                self.sums[1] += share.detach()
                self.counts[i] = self.counts.get(i, 0) + counts_E
                tape.seed(share)
        if a.chunk == s.last:
            with record_function("lm_head+loss"):
                share, ce = seg(self.loss, h, labels_BS)
            self.sums[0] += ce
            self.sums[2] += (labels_BS != IGNORE_INDEX).sum()
            if tape:
                tape.seed(share)
            h = None
        else:
            self.data[(Op.F, a.chunk, a.micro)] = h.detach()
        if tape:
            self.tapes[(a.chunk, a.micro)] = (tape, h_in, h)

    def loss(self, h_BSD: Tensor, labels_BS: Tensor) -> tuple[Tensor, Tensor]:
        ce = loss_sum(self.stages.epilogue(h_BSD), self.stages.model.lm_head, labels_BS.flatten())
        return ce.float() / self.label_tokens, ce.detach().float()

    def backward(self, a: Action) -> Steps:
        tape, h_in, h_out = self.tapes.pop((a.chunk, a.micro))
        tape.tag = f"B{a.chunk}.{a.micro}"
        if h_out is not None:
            tape.seed(h_out, self.data.pop((Op.B, a.chunk + 1, a.micro)))
        yield from tape.backward()
        if h_in is not None:
            self.data[(Op.B, a.chunk, a.micro)] = tape.grad(h_in)

    def transfer(self, batch: list[P2P]) -> None:
        mesh, ops, received = self.stages.mesh, [], []
        for t in batch:
            key = (t.op, t.chunk, t.micro)
            peer = dist.get_global_rank(mesh.pp_group, t.peer)
            if t.send:  # what a neighbour consumes is not needed here after the transfer
                ops.append(dist.P2POp(dist.isend, self.data.pop(key).contiguous(), peer, mesh.pp_group))
            else:
                ids_BS = self.micro[t.micro][0]
                D = self.stages.model.cfg.hidden_size
                buf = torch.empty(*ids_BS.shape, D, dtype=self.stages.dtype, device=mesh.device)
                ops.append(dist.P2POp(dist.irecv, buf, peer, mesh.pp_group))
                received.append((key, buf))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for key, buf in received:
            self.data[key] = buf


def _to_device(t: Tensor | None, device: torch.device) -> Tensor | None:
    # From pinned memory without blocking: a copy from pageable memory waits for the whole stream.
    if t is None or t.device.type != "cpu" or device.type != "cuda":
        return None if t is None else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _micro_on_device(micro: list, mesh: parallel.Mesh) -> list:
    return [tuple(_to_device(t, mesh.device) for t in local_tokens(*m[:2], mesh, *m[2:])) for m in micro]


def train_step(
    stages: Stages,
    optimizer: torch.optim.Optimizer,
    micro: list[tuple[Tensor, Tensor]],
    lr: float,
    aux: Aux,
    grad_clip: float,
    bias_rate: float,
) -> StepResult:
    """One optimizer step over this rank's micro-batches [(inputs_BS, labels_BS[, pos_BS])] -> device
    tensors: no host sync, the CPU queues the step ahead of the GPU. A non-finite loss or norm skips the
    update (step_values raises)."""
    mesh, model = stages.mesh, stages.model
    micro = _micro_on_device(micro, mesh)
    aux = aux._replace(micro_batches=len(micro))
    sums, counts, label_tokens = (stages.graph or _schedule_work)(stages, micro, aux)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss, aux_loss = sums[0] / label_tokens, sums[1].clone()  # sums may be a graph's output (StepGraph)
    with record_function("optimizer"):
        grad_norm = parallel.grad_norm(list(model.parameters()), mesh)
        finite = torch.isfinite(loss + aux_loss + grad_norm)
        coef = parallel.clip_coef(grad_norm, grad_clip)
        optimizer.step(grad_scale=torch.where(finite, coef, torch.nan).reshape(1))
        optimizer.zero_grad(set_to_none=True)
        update_expert_bias(stages.biases, counts, finite * bias_rate)
    return StepResult(loss, aux_loss, grad_norm, _all_counts(counts, stages))


def _schedule_work(stages: Stages, micro: list, aux: Aux) -> tuple[Tensor, dict[int, Tensor], Tensor]:
    """-> (cross-entropy and aux sums [2], expert counts per MoE layer, global label tokens)."""
    mesh = stages.mesh
    labels = sum((y != IGNORE_INDEX).sum() for _, y, *_ in micro)
    label_tokens = parallel.all_reduce_sum(labels, mesh).clamp(min=1)  # none: cross-entropy 0
    # Reduced once, in each unit's last backward segment (Tape(final=True)).
    for unit in stages.units:
        unit.set_requires_gradient_sync(False, recurse=False)
    run = _Run(stages, micro, label_tokens, aux, True)
    run.run(schedule(mesh.layout.pp, mesh.pp_rank, len(micro), stages.overlap, stages.queue is not None))
    assert stages.queue is None or not len(stages.queue), "a W for every I of the schedule"
    for unit in stages.units:  # what stayed gathered through the step (Stages)
        unit.reshard()
    return parallel.all_reduce_sum(run.sums[:2].clone(), mesh, pp=True), run.counts, label_tokens


def step_values(loss: Tensor, aux: Tensor, grad_norm: Tensor, counts_LE: Tensor | None):
    """train_step's outputs in one host sync -> (loss, aux, grad norm, max/mean load per MoE layer)."""
    parts = [loss.float().reshape(1), aux.float().reshape(1), grad_norm.float().reshape(1)]
    if counts_LE is not None:
        parts.append(counts_LE.amax(1) / counts_LE.mean(1))
    loss, aux, norm, *load = torch.cat(parts).tolist()
    if not math.isfinite(loss + aux + norm):
        raise FloatingPointError(f"loss is {loss} (aux {aux}, gradient norm {norm})")
    return loss, aux, norm, [x for x in load if x == x]  # dense layers' 0/0 left out


@torch.no_grad()
def update_expert_bias(biases: dict[int, Tensor], counts: dict[int, Tensor], rate: Tensor | float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): bias += rate * sign(mean load - load), per MoE layer."""
    assert biases.keys() <= counts.keys() or not biases, (biases.keys(), counts.keys())
    for i, bias_E in biases.items():
        bias_E += rate * torch.sign(counts[i].mean() - counts[i])


def _all_counts(counts: dict[int, Tensor], stages: Stages) -> Tensor | None:
    if not stages.num_experts:
        return None
    out = torch.zeros(stages.model.cfg.num_hidden_layers, stages.num_experts, device=stages.mesh.device)
    for i, c in counts.items():
        out[i] = c
    if stages.mesh.pp_group is not None:
        dist.all_reduce(out, group=stages.mesh.pp_group)
    return out


@torch.no_grad()
def evaluate(stages: Stages, batches) -> float:
    mesh = stages.mesh
    micro = _micro_on_device(list(batches), mesh)
    run = _Run(stages, micro, 1, Aux(), grad=False)
    run.run(forward_schedule(mesh.layout.pp, mesh.pp_rank, len(micro)))
    total = parallel.all_reduce_sum(run.sums[[0, 2]].clone(), mesh, pp=True)
    return (total[0] / total[1]).item()
