"""Muon on the hidden matrices (pith-train README, Training). One matrix W [M, N] with gradient G, one
step (Moonlight, arXiv:2502.16982, Nesterov form):
    B <- mu * B + G;  U <- G + mu * B;  O <- NS5(U) ~ P Q^T of U = P S Q^T
    W <- W * (1 - lr * wd) - lr * 0.2 * sqrt(max(M, N)) * O
NS5: X = U / (||U||_F + 1e-7), wide (transposed when M > N), then 5 steps X <- a X + (b A + c A^2) X,
A = X X^T, in bf16. O's RMS is ~1 / sqrt(max(M, N)): the scale gives AdamW's typical RMS of ~0.2.

Shape legend: M rows, N columns, E matrices in a batch.
"""

import math

import torch
import torch.distributed as dist
from pith_engine.parallel import to_local
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: steepest slope at zero
NS_STEPS = 5


def newton_schulz(u_EMN: Tensor, dtype: torch.dtype) -> Tensor:
    a, b, c = NS_COEFFICIENTS
    x = u_EMN.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(NS_STEPS):
        A_EMM = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(A_EMM, A_EMM, A_EMM, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """2-D weights and stacked [E, ., .] expert weights, less the embedding, lm_head and routers (the
    nn.Linear children of the module holding a layer's experts)."""
    experts = [layer.experts for layer in model.layers.values() if layer.experts is not None]
    owners = [m for m in model.modules() if any(c is e for c in m.children() for e in experts)]
    routers = [c for m in owners for c in m.children() if isinstance(c, nn.Linear)]
    ends = (model.embed_tokens, model.lm_head) if hasattr(model, "lm_head") else ()  # pipeline rank 0's
    adamw = {id(p) for m in (*ends, *routers) for p in m.parameters()}
    stacked = {id(p) for e in experts for p in e.parameters()}
    return [
        p
        for p in model.parameters()
        if p.requires_grad and id(p) not in adamw and p.ndim == (3 if id(p) in stacked else 2)
    ]


def _orthogonalise(mats: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """NS5 of every [E, M, N] in `mats`, a batch per shape."""
    out: list[Tensor | None] = [None] * len(mats)
    shapes = {tuple(m.shape[1:]) for m in mats}
    for shape in shapes:
        idx = [i for i, m in enumerate(mats) if tuple(m.shape[1:]) == shape]
        done = newton_schulz(torch.cat([mats[i].to(dtype) for i in idx]), dtype)
        for i, o in zip(idx, done.split([mats[i].shape[0] for i in idx])):
            out[i] = o
    return out


def _rows(m: int, ranks: int) -> list[int]:
    """Rows of each rank's shard of an m-row tensor (FSDP2 splits dim 0 as torch.chunk does)."""
    c = -(-m // ranks)
    return [max(0, min(c, m - i * c)) for i in range(ranks)]


def _owners(shapes: list[torch.Size], ranks: int) -> list[int]:
    """Each matrix's owner: the least loaded rank so far, largest NS cost (M * N * min(M, N)) first."""
    cost = [s[0] * s[1] * min(s) for s in shapes]
    load, owner = [0] * ranks, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -cost[i]):
        owner[i] = min(range(ranks), key=load.__getitem__)
        load[owner[i]] += cost[i]
    return owner


def _flat(ts: list[Tensor], empty: Tensor) -> Tensor:
    return torch.cat([t.flatten() for t in ts]) if ts else empty


def _exchange(send: list[Tensor], recv_sizes: list[int], group) -> list[Tensor]:
    recv = send[0].new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, torch.cat(send), recv_sizes, [t.numel() for t in send], group=group)
    return list(recv.split(recv_sizes))


def _orthogonalise_spread(shapes: list[torch.Size], u_local: list[Tensor], mesh, dtype) -> list[Tensor]:
    """This rank's rows of NS5 of each row-sharded matrix: each goes whole to its owner rank (_owners)
    and its rows of O come back, two all-to-alls."""
    group, W, me, n = mesh.get_group(), mesh.size(), mesh.get_local_rank(), len(shapes)
    owner = _owners(shapes, W)
    rows = [_rows(s[0], W) for s in shapes]
    owned = [[i for i in range(n) if owner[i] == j] for j in range(W)]
    if any(u.shape[0] != r[me] for u, r in zip(u_local, rows)):
        raise ValueError(
            f"Muon: shards {[tuple(u.shape) for u in u_local]} are not torch.chunk's of {shapes}"
        )
    u_local = [u.to(dtype) for u in u_local]
    empty = u_local[0].new_empty(0)
    # To owner j: my rows of each matrix it owns, in index order; from rank r: its rows of mine.
    from_r = [[rows[i][r] * shapes[i][1] for i in owned[me]] for r in range(W)]
    recv = _exchange([_flat([u_local[i] for i in owned[j]], empty) for j in range(W)],
                     [sum(s) for s in from_r], group)  # fmt: skip
    parts = [t.split(s) if s else () for t, s in zip(recv, from_r)]
    whole = [torch.cat(p).view(1, *shapes[i]) for i, p in zip(owned[me], zip(*parts))]
    done = _orthogonalise(whole, dtype)
    back = [_flat([o[0].split(rows[i])[r] for i, o in zip(owned[me], done)], empty) for r in range(W)]
    got = _exchange(back, [sum(u_local[i].numel() for i in owned[j]) for j in range(W)], group)
    out: list[Tensor | None] = [None] * n
    for j in range(W):
        for i, t in zip(owned[j], got[j].split([u_local[i].numel() for i in owned[j]])):
            out[i] = t.view_as(u_local[i])
    return out


class Muon(torch.optim.Optimizer):
    """Muon over [M, N] and [E, M, N] tensors (or FSDP2 DTensors sharded on dim 0); `ns_dtype`: NS5's."""

    def __init__(self, params, lr: float, momentum: float, weight_decay: float, ns_dtype):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self.ns_dtype = ns_dtype
        for p in (p for g in self.param_groups for p in g["params"]):
            if p.ndim not in (2, 3) or (isinstance(p, DTensor) and p.placements != (Shard(0),)):
                raise ValueError(f"Muon takes matrices or stacks of them sharded on dim 0, got {p.shape}")

    @torch.no_grad()
    def step(self, closure=None, grad_scale: Tensor | None = None):
        """`grad_scale` [1] scales every gradient; not finite, the step changes nothing (no host sync)."""
        todo = []  # (param, its group, this rank's U)
        ok = None if grad_scale is None else torch.isfinite(grad_scale)
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                g, buf = to_local(p.grad), to_local(self.state[p]["momentum_buffer"])
                if ok is None:
                    buf.mul_(mu)
                else:  # a skipped step keeps the momentum: B * 1 + 0
                    g = torch.where(ok, g * grad_scale, 0.0)
                    buf.mul_(1 + (mu - 1) * ok.to(buf.dtype))
                buf.add_(g)
                todo.append((p, group, g.add(buf, alpha=mu)))
        # Whole matrices here: plain tensors and expert stacks (a shard holds whole experts).
        spread = [i for i, (p, _, _) in enumerate(todo) if isinstance(p, DTensor) and p.ndim == 2]
        whole = [i for i in range(len(todo)) if i not in spread]
        o = dict(zip(whole, _orthogonalise([todo[i][2].view(-1, *todo[i][0].shape[-2:]) for i in whole],
                                           self.ns_dtype)))  # fmt: skip
        # Meshes in parameter order (the same on every rank: the collectives must match).
        for mesh in dict.fromkeys(todo[i][0].device_mesh for i in spread):
            on = [i for i in spread if todo[i][0].device_mesh is mesh]
            got = _orthogonalise_spread([todo[i][0].shape for i in on], [todo[i][2] for i in on], mesh,
                                        self.ns_dtype)  # fmt: skip
            o.update(zip(on, got))
        for i, (p, group, _) in enumerate(todo):
            lr, M, N = group["lr"], *p.shape[-2:]
            w = to_local(p)
            o_i, rate = o[i].reshape(w.shape).to(w.dtype), lr * 0.2 * math.sqrt(max(M, N))
            if ok is None:
                w.mul_(1 - lr * group["weight_decay"]).add_(o_i, alpha=-rate)
            else:
                on = ok.to(w.dtype)
                w.mul_(1 - lr * group["weight_decay"] * on).sub_(o_i * (rate * on))


class Chain:
    """Optimizers stepped as one (DCP's optimizer state dicts take an iterable of them)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    def __iter__(self):
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self, closure=None, grad_scale: Tensor | None = None) -> None:
        for o in self.optimizers:
            o.step(grad_scale=grad_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)
