"""The optimizer step of train_step against the path it replaced (fp32, CPU), its device-side skip of
a non-finite step, and its host syncs (counted)."""

import copy
import inspect
import re

import pith_models
import pytest
import torch
from pith_engine import parallel
from pith_engine.step import Stages, step_values, train_step
from pith_train.data import PackedDataset, WindowLoader
from pith_train.optim import build_optimizer
from pith_train.train import parallel_layout, step_settings
from torch.utils._python_dispatch import TorchDispatchMode

CPU = parallel.Mesh(parallel.Layout(), torch.device("cpu"))


def _with_grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 10 ** torch.empty(p.shape).uniform_(
            -3, 0, generator=gen
        )


@pytest.mark.parametrize("max_norm", [0.05, 1e9, 0.0])  # binding, not binding, off
def test_clip_folded_into_adamw_equals_clip_then_torch_adamw_bit_for_bit(micro_config, micro_hf, max_norm):
    cfg = micro_config(f"--optim.grad_clip={max_norm}")
    new = pith_models.from_pretrained(micro_hf)
    old = copy.deepcopy(new)
    opt_new = build_optimizer(new, cfg)
    o = cfg.optim
    opt_old = torch.optim.AdamW(  # the previous build_optimizer on CPU
        [{"params": [p for p in old.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
         {"params": [p for p in old.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=cfg.train.lr, betas=(o.beta1, o.beta2), eps=o.eps,
    )  # fmt: skip
    for step in range(3):
        _with_grads(new, step)
        _with_grads(old, step)
        norm = parallel.grad_norm(list(new.parameters()), CPU)
        opt_new.step(grad_scale=parallel.clip_coef(norm, max_norm).reshape(1))
        assert torch.equal(norm, parallel.clip_grad_norm_(list(old.parameters()), max_norm, CPU))
        opt_old.step()
    for (name, a), b in zip(new.named_parameters(), old.parameters()):
        assert torch.equal(a, b), name
        sa, sb = opt_new.state[a], opt_old.state[b]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), (
            name
        )  # checkpoints alike
    assert not torch.equal(new.lm_head.weight, pith_models.from_pretrained(micro_hf).lm_head.weight)


class SyncCounter(TorchDispatchMode):
    """Records the pith source line of every host read of a tensor value (.item(), int(), float(),
    .tolist(): aten._local_scalar_dense, a device sync on CUDA)."""

    def __init__(self):
        super().__init__()
        self.sites = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            frame = next(
                f
                for f in inspect.stack()[1:]
                if "/packages/pith-" in f.filename  # this repository's code, wherever the checkout lies
            )
            self.sites.append(f"{frame.filename.rsplit('/', 1)[-1]}:{frame.function}")
        return func(*args, **(kwargs or {}))


def _setup(micro_config, micro_hf, byte_data, *overrides):
    cfg = micro_config(*overrides)
    model = pith_models.from_pretrained(micro_hf)
    loader = WindowLoader(PackedDataset(str(byte_data)), cfg.data.seq_len, cfg.data.val_windows, 0)
    micro = loader.step_batch(0, cfg.train.global_batch, cfg.train.micro_batch, 0, 1)
    biases = [
        b for layer in model.layers.values() for n, b in layer.named_buffers() if n.endswith("expert_bias")
    ]
    run = lambda: train_step(  # noqa: E731
        Stages(model, parallel_layout(cfg, torch.device("cpu"))),
        build_optimizer(model, cfg),
        micro,
        1e-2,
        *step_settings(cfg, model),
    )
    return model, biases, run


def test_train_step_reads_nothing_on_the_host_and_step_values_reads_once(micro_config, micro_hf, byte_data):
    _, _, run = _setup(micro_config, micro_hf, byte_data)  # 2 micro-batches
    with SyncCounter() as counter:
        out = run()
    # Left: moe_permute's and linear_cross_entropy's input checks (CPU only: skipped on CUDA, where
    # they would sync) and the
    # optimizer's step count (a host tensor on every device). The previous train_step read the
    # label count once per micro-batch and once more, the loss, the aux loss and the gradient norm.
    assert counter.sites and set(counter.sites) <= {
        "moe_permute.py:moe_permute", "cross_entropy.py:linear_cross_entropy", "optim.py:step"
    }  # fmt: skip
    # The counter sees .item() / int() / float(); .tolist() of a CPU tensor reads memory directly.
    with SyncCounter() as counter:
        int(out[0] > 0)
    assert counter.sites == [
        "test_step.py:test_train_step_reads_nothing_on_the_host_and_step_values_reads_once"
    ]
    assert not re.search(r"\.item\(|\.tolist\(|(?<![\w.])(int|float|bool)\(", inspect.getsource(train_step))
    loss, aux, norm, load = step_values(*out)
    assert [loss, aux, norm] == [out[0].item(), out[1].item(), out[2].item()] and len(load) == 2


def test_a_non_finite_step_leaves_weights_moments_and_biases_and_then_raises(
    micro_config, micro_hf, byte_data
):
    model, biases, run = _setup(micro_config, micro_hf, byte_data)
    with torch.no_grad():
        model.embed_tokens.weight[:, 0] = float("nan")  # every token: nan loss and gradients
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = run()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True)
    assert all(torch.equal(b, torch.zeros_like(b)) for b in biases)
    with pytest.raises(FloatingPointError, match="loss is nan"):
        step_values(*out)
