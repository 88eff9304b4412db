"""`pith-train plan CONFIG --measure`: one process plays a rank of the layout on this device, the
others mirrored (`Mirror`): its memory beside the plan."""

import contextlib
import os
import statistics
import time

import pith_ops
import torch
import torch.distributed as dist
from pith_engine.parallel import to_local
from pith_engine.step import train_step
from torch._C._distributed_c10d import PythonCallbackWork
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pith_train import plan, train
from pith_train.bench import random_steps
from pith_train.config import Config, model_config
from pith_train.optim import build_optimizer


class Mirror(dist.ProcessGroup):
    """`size` ranks that each do what this one does (pith-train README, Measuring a rank): values
    finite, routing realistic, every buffer the caller's, of its real size."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self.n, self.sent = size, {}  # (shape, dtype) -> sends not yet received, oldest first

    def _done(self, fill=lambda: None):
        fill()  # on the issuing stream, as NCCL's; a wait on another stream waits for it there
        if (ready := torch.cuda.Event() if torch.cuda.is_available() else None) is not None:
            ready.record()
        return PythonCallbackWork(
            lambda _: ready is None or torch.cuda.current_stream().wait_event(ready) or 1
        )

    def _sum(self, x, opts):  # identical ranks: a sum n times x, max, min and avg x
        return x.mul_(self.n) if opts.reduceOp in (dist.ReduceOp.SUM, dist.ReduceOp.PREMUL_SUM) else x

    def allreduce(self, tensors, opts):
        return self._done(lambda: [self._sum(t, opts) for t in tensors])

    def all_gather_single(self, out, x, opts):  # FSDP2 gathers in place: x may be out's
        x, r = x.reshape(-1), self.rank()

        def fill():  # rank r + k's: this shard turned by k (copies tie a router's scores, top-k picks
            for j, o in enumerate(out.view(self.n, -1)):  # the lowest ids)
                k = (j - r) % len(x) * x.is_floating_point()
                if o.data_ptr() != x.data_ptr():
                    o[:k].copy_(x[len(x) - k :])
                    o[k:].copy_(x[: len(x) - k])

        return self._done(fill)

    def allgather(self, outs, xs, opts):
        return self._done(lambda: [o.copy_(x) for os, x in zip(outs, xs) for o in os])

    def reduce_scatter_single(self, out, x, opts):
        return self._done(lambda: self._sum(out.copy_(x.view(self.n, -1)[self.rank()].view_as(out)), opts))

    def all_to_all_single(self, out, x, out_splits, in_splits, opts):  # from each: what it sends itself
        r, ins = self.rank(), in_splits or [len(x) // self.n] * self.n
        own = x[sum(ins[:r]) : sum(ins[: r + 1])].reshape(-1)
        outs = out.split(out_splits or len(out) // self.n)
        return self._done(lambda: [_repeat_into(o.reshape(-1), own) for o in outs])

    def broadcast(self, tensors=(), opts=None):  # also barrier(opts=...)
        return self._done()

    barrier = broadcast

    def send(self, tensors, dst, tag):
        for t in tensors:
            self.sent.setdefault((t.shape, t.dtype), []).append(t)
        return self._done()

    def recv(self, tensors, src, tag):
        # Claimed at the wait, after the batch's sends (DualPipeV batches both): no deadlock.
        def fill(_):
            for t in tensors:
                sent = self.sent.get((t.shape, t.dtype))
                t.copy_(sent.pop(0)) if sent else t.normal_()
            return True

        return PythonCallbackWork(fill)

    _allgather_base, alltoall_base = all_gather_single, all_to_all_single  # torch 2.11's names
    _reduce_scatter_base = reduce_scatter_single

    def _get_backend(self, device):  # batch_isend_irecv: no coalescing
        return self

    def getBackendName(self):
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self.name = name

    group_name = property(lambda self: self.name)


def _repeat_into(out, x):
    """out <- x, repeated or cut to out's length (pieces differ in size); x empty: zeros."""
    if not len(x):
        return out.zero_()
    for i in range(0, len(out), len(x)):
        out[i : i + len(x)].copy_(x[: len(out) - i])


BACKEND = "pith-mirror"
# String-keyed as torch requires: DeviceMesh, FSDP2 and DCP make subgroups by the default group's
# backend name.
dist.Backend.register_backend(BACKEND, lambda store, r, n, timeout: Mirror(r, n), devices=["cpu", "cuda"])


class Live(TorchDispatchMode):
    """Live bytes of the CPU storages that ops under it create, and their peak: the CPU allocator keeps
    no statistics."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and (s := t.untyped_storage()).nbytes():
                if (ptr := s.data_ptr()) in seen or not self._free(ptr):
                    continue
                self.live[ptr] = StorageWeakRef(s), s.nbytes()
                self.now += s.nbytes()
        if self.now > self.peak:  # frees only lower `now`: count them when it could set a peak
            for ptr in list(self.live):
                self._free(ptr)
            self.peak = max(self.peak, self.now)
        return out

    def _free(self, ptr: int) -> bool:
        """Whether no storage lives at `ptr` (forgetting a dead one)."""
        if ptr in self.live and not self.live[ptr][0].expired():
            return False
        self.now -= self.live.pop(ptr, (None, 0))[1]
        return True


def _tensors(named) -> dict[str, tuple]:
    return {k: (tuple(t.shape), t.dtype, t.numel() * t.element_size()) for k, t in named if t is not None}


def heaviest(cfg: Config, m: plan.Model, cuda: bool) -> int:
    """The global rank (data, context, expert 0) of the pipeline rank that holds most."""
    return plan.plan(cfg, m, cuda).rank * (cfg.world // cfg.parallel.pp)


def measure(cfg: Config, rank: int | None = None, steps: int = 2, warmup: int = 1) -> dict:
    """`warmup` + `steps` steps on random tokens as `rank` (default: the heaviest), mirrored unless
    under torchrun -> held tensors {kind: {name: (shape, dtype, bytes)}}, peak, plans, step s."""
    device = train.pick_device(cfg.train.device, "train.device", cfg.train.cpu_threads)
    cuda, model_cfg, world = device.type == "cuda", model_config(cfg.model), cfg.world
    plan.check(cfg, model_cfg, device, "", world)
    m = plan.model_shape(model_cfg)
    rank = heaviest(cfg, m, cuda) if rank is None else rank
    if not 0 <= rank < world or steps < 1:
        raise ValueError(f"--rank {rank}, --steps {steps}: expected a rank 0 to {world - 1}, steps >= 1")
    if mirrored := not dist.is_initialized() and "RANK" not in os.environ:  # torchrun: the real group
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world)
    try:
        mesh = train.parallel_layout(cfg, device)
        rank = dist.get_rank()
        torch.manual_seed(cfg.train.seed)
        model = train.build_model(
            cfg.model, device, cfg.train.seed, mesh, torch.bfloat16 if cuda else None, mirrored
        )
        train.apply_fp8(cfg, model, cuda)
        optimizer = build_optimizer(model, cfg)
        stages, settings = train.trainer_stages(cfg, model, mesh), train.step_settings(cfg, model)
        names = {p: n for n, p in model.named_parameters()}
        held = {"parameters": _tensors((n, to_local(p)) for p, n in names.items())}
        update = optimizer.step

        def step_with_snapshot(**kw):  # zero_grad drops them
            held["gradients"] = _tensors((n, to_local(pith_ops.grad(p))) for p, n in names.items())
            return update(**kw)

        optimizer.step = step_with_snapshot
        B, S, V = cfg.train.global_batch // mesh.layout.data_ranks, cfg.data.seq_len, m.cfg.vocab_size
        seed = cfg.train.seed + mesh.data_rank
        batches = random_steps(V, B, S, cfg.train.micro_batch, device, seed, cfg.data.document_mask)
        live, sync = Live(), torch.cuda.synchronize if cuda else lambda: None
        seconds = []
        for i in range(warmup + steps):
            micro = next(batches)
            if i == warmup and cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            with live if i >= warmup and not cuda else contextlib.nullcontext():
                train_step(stages, optimizer, micro, cfg.train.lr, *settings)
                sync()
            seconds.append(time.perf_counter() - start)
        held["optimizer state"] = _tensors(
            (f"{names[p]}.{k}", to_local(t)) for o in getattr(optimizer, "optimizers", [optimizer])
            for p, state in o.state.items() for k, t in state.items()
        )  # fmt: skip
        static = sum(b for kind in ("parameters", "optimizer state") for *_, b in held[kind].values())
        peak = torch.cuda.max_memory_allocated(device) if cuda else static + live.peak
        start, at_step = plan.rank_plan(cfg, m, mesh.pp_rank, cuda)
        return {"rank": rank, "held": held, "peak": peak, "static": static, "device": str(device),
                "plan": max(start, at_step, key=lambda x: x.total), "step_plan": at_step,
                "steps_s": seconds[warmup:]}  # fmt: skip
    finally:
        if mirrored:
            dist.destroy_process_group()


def report(r: dict) -> str:
    out, gib = r["plan"], plan.GIB
    held = {k: sum(b for *_, b in v.values()) for k, v in r["held"].items()}
    grads = held["gradients"]
    held["gradients"] = grads if out is r["step_plan"] else None  # measured at the optimizer step
    rows = [(k, v, held.get(k)) for k, v in sorted(out.terms.items(), key=lambda kv: -kv[1])]
    rows.append(("total (allocated), peak", out.total, r["peak"]))
    cell = lambda x: "-" if x is None else f"{x / gib:.3f}"
    return "\n".join([
        f"rank {r['rank']} (pipeline rank {out.rank}) measured on {r['device']}, the other ranks mirrored;"
        f" the plan at {out.moment}, GiB:",
        f"  {'term':<30}{'planned':>10}{'measured':>10}",
        *(f"  {k:<30}{cell(p):>10}{cell(m):>10}" for k, p, m in rows),
        f"measured / planned peak: {r['peak'] / out.total:.3f}; gradients at the optimizer step, planned"
        f" {cell(r['step_plan'].terms['gradients'])}, measured {cell(grads)}",
        f"step without communication: {statistics.median(r['steps_s']) * 1e3:.1f} ms, the median of"
        f" {', '.join(f'{t * 1e3:.1f}' for t in r['steps_s'])} (a lower bound on the real step)",
    ])  # fmt: skip
