"""A test oracle shared by the engine's pipeline tests and the trainer's layout tests (imported by path:
`sys.path` holds this folder in their rank scripts)."""

import pith_ops
import torch
import torch.distributed as dist
from pith_engine.parallel import Mesh, expert_param_names
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def full_state(model: nn.Module, mesh: Mesh, grads: bool = False) -> dict[str, Tensor]:
    """Every parameter (or its gradient, grads) of this rank's layers whole: FSDP shards gathered,
    and the experts of every EP rank, as one process holds them. A collective: every rank calls it."""
    experts = expert_param_names(model)
    out = {}
    for name, p in model.named_parameters():
        t = pith_ops.grad(p).to(p.dtype) if grads else p
        # A copy: over a mesh of one rank full_tensor() is the local tensor itself.
        t = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        if name in experts and mesh.layout.ep > 1:
            parts = [torch.empty_like(t) for _ in range(mesh.layout.ep)]
            dist.all_gather(parts, t.contiguous(), group=mesh.ep_group)
            t = torch.cat(parts)
        out[name] = t
    return out
