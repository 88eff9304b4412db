"""FP8 GEMMs: the switch a model's projections and experts carry (FP8Switch, use_fp8), their weights'
kept FP8 copies, and FSDP2's all-gather of those weights in e4m3 (gather_in_fp8, GatheredFP8)."""

from collections.abc import Callable

import pith_ops
import torch
import torch.distributed as dist
from pith_ops.fp8_quant import FP8Weight, weight_amax
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


class GatheredFP8(Tensor):
    """A weight FSDP2 all-gathered in e4m3 (gather_in_fp8): the unsharded parameter, of the weight's
    shape and compute dtype but holding only `copies` (an fp8_quant.FP8Weight), which the FP8 GEMMs
    read. Its gradient reaches it through a stand-in (pith_ops.stand_in); any other op is an error."""

    copies: FP8Weight

    @staticmethod
    def __new__(cls, copies: FP8Weight, dtype: torch.dtype):
        t = Tensor._make_wrapper_subclass(cls, copies.q.shape, dtype=dtype, device=copies.q.device)
        t.copies = copies
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w, aten = args[0], torch.ops.aten
        same_view = func is aten.as_strided.default and tuple(args[1]) == tuple(w.shape)  # FSDP's
        if func in (aten.detach.default, aten.alias.default) or same_view:
            return cls(w.copies, w.dtype)
        raise NotImplementedError(
            f"{func} on a weight FSDP gathered in FP8: only the FP8 GEMMs read it; set"
            " train.fp8_all_gather=false to use it otherwise"
        )


class FP8Switch:
    """A module whose GEMMs run in FP8 while `fp8` is set, its weight gradients to `wgrad_queue`."""

    fp8: bool = False
    wgrad_queue = None  # pith_engine.wgrad.set_wgrad_queue
    weight_ndim = 3  # an experts module's [E, in, out] (a Linear's: 2)

    @staticmethod
    def fp8_weight(w: Tensor, quantize: Callable[[Tensor], tuple]) -> tuple:
        """w's FP8 copies: its kept copies while valid, else quantize(w), kept when w's optimizer marks
        it (pith-engine README, "FP8 weight copies"); compiled: quantised per call (no Python state)."""
        if isinstance(w, GatheredFP8):
            return w.copies[:4]
        if torch.compiler.is_compiling():
            return quantize(w)
        kept = pith_ops.kept_copy(w, torch.float8_e4m3fn)
        if kept is not None:
            return kept[:4]
        copies = quantize(w)
        if FP8Switch.keeps_copies(w) and torch.is_grad_enabled():
            pith_ops.keep(w, FP8Weight(*copies, weight_amax(w)), torch.float8_e4m3fn)
        return copies

    @staticmethod
    def keeps_copies(w: Tensor) -> bool:
        """Whether fp8_weight keeps w's copies: its optimizer marks it and it is not FSDP's DTensor."""
        return bool(w.__dict__.get("_pith_keep_grad")) and type(w) in (Tensor, nn.Parameter)


def use_fp8(model: nn.Module, enabled: bool = True, lm_head: bool = False) -> None:
    """`model`'s projections and expert GEMMs in FP8 (recipe: pith-ops README); lm_head by its own switch."""
    for name, m in model.named_modules():
        if isinstance(m, FP8Switch):
            m.fp8 = lm_head if name == "lm_head" else enabled


def gather_in_fp8(model: nn.Module, experts_only: bool = False) -> int:
    """Let FSDP2 all-gather the FP8 weights of `model` in e4m3 (pith-train README,
    train.fp8_all_gather). experts_only: a compiled graph does not take a GatheredFP8. Call after
    use_fp8, before the first forward (FSDP's lazy init looks for the hooks). -> how many weights."""
    tied = {
        id(p) for m in model.modules() for p in m.parameters(recurse=False) if not isinstance(m, FP8Switch)
    }
    hooked = 0
    for name, m in model.named_modules():
        if not (isinstance(m, FP8Switch) and m.fp8) or (experts_only and m.weight_ndim == 2):
            continue
        for pname, p in fp8_weights(m):
            if not isinstance(p, DTensor):
                continue
            ranks = p.device_mesh.size()
            why = (
                "is shared with a module that does not quantise it" if id(p) in tied
                else f"does not shard evenly over {ranks} ranks" if p.shape[0] % ranks
                else "has rows not a multiple of 16 (CUDA's FP8 GEMMs)" if p.is_cuda and p.shape[-2] % 16
                else None
            )  # fmt: skip
            if why:
                raise ValueError(f"train.fp8_all_gather: {name}.{pname} {tuple(p.shape)} {why}; turn it off")
            local = p._local_tensor
            local.fsdp_pre_all_gather, local.fsdp_post_all_gather = _fp8_gather_hooks(local, tuple(p.shape))
            hooked += 1
    return hooked


def _fp8_gather_hooks(local: Tensor, shape: tuple):
    def pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy):
        held = local.shape[0]
        start = mesh.get_local_rank() * held
        amax = weight_amax(local)
        if len(shape) == 3:  # each rank's experts whole: their amaxes, zeros elsewhere
            amax = torch.zeros(shape[0], dtype=torch.float32, device=local.device).index_copy_(
                0, torch.arange(start, start + held, device=local.device), amax
            )
        dist.all_reduce(amax, dist.ReduceOp.MAX, group=mesh.get_group())
        own = amax[start : start + held] if len(shape) == 3 else amax
        q = pith_ops.quantize_weight(local.detach(), own)[0]
        return (q.view(torch.uint8),), amax

    def post_all_gather(outputs, amax, param_dtype, *, out=None):
        q = outputs[0].view(torch.float8_e4m3fn).view(shape)
        if out is not None:  # the same storages, refilled by FSDP: the copies rewritten in place
            out.copies = pith_ops.copies_of_quantized(q, amax, out.copies)
            return None
        copies = pith_ops.copies_of_quantized(q, amax)  # qt: unpadded (rows of 16), or a view of q
        return GatheredFP8(copies, param_dtype), (outputs[0], copies.qt)  # storages FSDP frees, refills

    return pre_all_gather, post_all_gather


def fp8_weights(m: FP8Switch) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in m.named_parameters(recurse=False) if p.ndim == m.weight_ndim]
