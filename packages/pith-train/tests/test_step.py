"""The optimizer step of train_step against the path it replaced (fp32, CPU), its device-side skip of
a non-finite step, its host syncs (counted), the kept bf16 weight casts against a cast per use, and
the step as a CUDA graph (StepGraph) against the eager step."""

import copy
import inspect
import math
import re

import pith_models
import pith_ops._common
import pytest
import torch
from pith_engine import parallel
from pith_engine.layers import Linear
from pith_engine.step import Stages, loss_sum, step_values, train_step
from pith_models.qwen3_moe import Experts
from pith_ops import kept_copy
from pith_train.data import PackedDataset, WindowLoader
from pith_train.optim import AdamW, build_optimizer
from pith_train.train import parallel_layout, step_settings
from torch import Tensor
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
        assert torch.equal(norm, parallel.grad_norm(list(old.parameters()), CPU))
        torch._foreach_mul_([p.grad for p in old.parameters()], parallel.clip_coef(norm, max_norm))
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


def test_a_skipped_step_is_a_no_op_for_adamw_step_counts_included():
    """A non-finite grad_scale leaves weights, moments and step counts: the next update's bias
    corrections are those of the steps actually taken (the count once advanced on the host)."""
    gen = torch.Generator().manual_seed(0)
    w0, grads = torch.randn(5, 3, generator=gen), [torch.randn(5, 3, generator=gen) for _ in range(2)]
    runs = []
    for scales in ([1.0, 1.0], [1.0, math.nan, 1.0]):
        w = torch.nn.Parameter(w0.clone())
        opt = AdamW([w], lr=1e-2, betas=(0.9, 0.95))
        for i, scale in enumerate(scales):
            w.grad = grads[min(i, 1)].clone()
            opt.step(grad_scale=torch.tensor([scale]))
            opt.zero_grad()
        runs.append((w.detach(), opt.state[w]))
    (w, st), (w_skip, st_skip) = runs
    assert torch.equal(w_skip, w) and st_skip["step"].item() == st["step"].item() == 2
    assert all(torch.equal(st_skip[k], st[k]) for k in ("exp_avg", "exp_avg_sq"))


def _bf16_steps(keep: bool, monkeypatch, micro: int) -> tuple[list[Tensor], list[Tensor]]:
    """3 AdamW steps of `micro` micro-batches each through what casts master weights to bf16 (the
    expert GEMMs, the fused loss's lm_head), bf16 rows as the trainer's stream has them on CUDA; kept,
    the gradients reach the norm and the update in bf16 (one micro-batch) or fp32-accumulated."""
    monkeypatch.setattr(pith_ops._common, "KEEP_COPIES", keep)
    torch.manual_seed(0)
    experts, lm_head = Experts(4, 16, 8), torch.nn.Linear(16, 40, bias=False)
    torch.nn.init.normal_(experts.w_gate_up, std=0.2)
    torch.nn.init.normal_(experts.w_down, std=0.2)
    params = [*experts.parameters(), *lm_head.parameters()]
    opt = AdamW(params, lr=1e-2)
    gen, losses = torch.Generator().manual_seed(1), []
    ends = torch.tensor([3, 3, 9, 12], dtype=torch.int32)  # an empty group
    for _ in range(3):
        for _ in range(micro):
            x = torch.randn(12, 16, generator=gen).bfloat16().requires_grad_()
            labels = torch.randint(40, (12,), generator=gen)
            loss = loss_sum(experts(x, ends)[None], lm_head, labels)
            loss.backward()
            losses.append(loss.detach())
        if keep:
            want = torch.bfloat16 if micro == 1 else torch.float32
            assert all(p.grad is None and pith_ops.grad(p).dtype == want for p in params)
        norm = parallel.grad_norm(params, CPU)
        opt.step(grad_scale=parallel.clip_coef(norm, 1.0).reshape(1))
        opt.zero_grad(set_to_none=True)
        if keep:  # the update rewrote the kept copies: the next forward casts nothing
            assert all(torch.equal(kept_copy(p), p.detach().bfloat16()) for p in params)
    return losses, [p.detach() for p in params]


@pytest.mark.parametrize("micro", [1, 2])
def test_kept_bf16_casts_train_bit_for_bit_like_a_cast_per_use(monkeypatch, micro):
    losses, params = _bf16_steps(True, monkeypatch, micro)
    old_losses, old_params = _bf16_steps(False, monkeypatch, micro)
    assert all(torch.equal(a, b) for a, b in zip(losses + params, old_losses + old_params))
    assert not torch.equal(losses[0], losses[-1])


def test_an_fp8_lm_head_keeps_no_bf16_cast_and_gets_the_gradient_the_cast_would():
    """loss_sum with an FP8 lm_head reads the weight's FP8 copies only; a stand-in (pith_ops.stand_in)
    takes its bf16 cast's place, so none is kept, and the gradient (held in bf16) is the cast's."""
    gen = torch.Generator().manual_seed(0)
    h_BSD = torch.randn(1, 32, 16, generator=gen).bfloat16()
    labels = torch.randint(40, (32,), generator=gen)
    w0 = torch.randn(40, 16, generator=gen) * 0.2
    out = []
    for via_loss_sum in (True, False):
        lm_head = Linear(16, 40, bias=False)
        with torch.no_grad():
            lm_head.weight.copy_(w0)
        lm_head.fp8, w = True, lm_head.weight
        pith_ops.keep_grads([w])
        if via_loss_sum:
            loss = loss_sum(h_BSD, lm_head, labels)
        else:
            w8 = pith_ops.quantize_weight(w.detach())
            w_VD = pith_ops.cast(w, torch.bfloat16)
            loss = pith_ops.linear_cross_entropy(h_BSD[0], w_VD, labels, -100, "sum", w8)
        loss.backward()
        assert (kept_copy(w) is None) == via_loss_sum and w.grad is None
        out.append((loss.detach(), pith_ops.grad(w)))
    (loss, g), (cast_loss, cast_g) = out
    assert g.dtype == torch.bfloat16 and torch.equal(loss, cast_loss) and torch.equal(g, cast_g)


def test_a_cuda_graph_step_needs_one_cuda_process(micro_hf):
    with pytest.raises(ValueError, match="one CUDA process.*train.cuda_graph"):
        Stages(pith_models.from_pretrained(micro_hf), CPU, cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("compile, docs", [(False, False), (True, False), (False, True), (True, True)])
def test_cuda_graph_steps_train_like_eager_steps(micro_config, micro_hf, byte_data, tiny_docs, compile, docs):
    """StepGraph (eager first step, captured second, replayed after) against eager steps: the same
    kernels on the same data, so the same losses and weights (two micro-batches: an overlapped pair).
    docs: document-masked windows of two of flex's 128-token blocks, packed with documents of 1-3
    tokens, so whether the second block's queries see the first block's keys (a document across
    token 128) changes between steps: a replay of the first step's block masks would differ."""
    cfg, dev = micro_config(f"--data.document_mask={docs}"), torch.device("cuda")
    data = PackedDataset(str(tiny_docs if docs else byte_data))
    loader = WindowLoader(data, 256 if docs else cfg.data.seq_len, cfg.data.val_windows, 0, docs=docs)
    G, mb = cfg.train.global_batch, cfg.train.micro_batch
    runs = []
    for graph in (False, True):
        model = pith_models.from_pretrained(micro_hf).to(dev)
        stages = Stages(model, parallel_layout(cfg, dev), compile, dtype=torch.bfloat16, cuda_graph=graph)
        optimizer, settings = build_optimizer(model, cfg), step_settings(cfg, model)
        batches = [loader.step_batch(i * G, G, mb, 0, 1) for i in range(5)]
        losses = [step_values(*train_step(stages, optimizer, b, 1e-2, *settings)) for b in batches]
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    with torch.no_grad():  # weights written outside the optimizer: the kept copies the graph reads are gone
        model.lm_head.weight.mul_(1.0)
    with pytest.raises(ValueError, match="written outside the optimizer"):
        train_step(stages, optimizer, batches[0], 1e-2, *settings)
    (eager, eager_params), (graphed, graphed_params) = runs
    if docs:  # a window of the first step whose block (1, 0) is empty, and the same row later not
        cut = torch.stack([torch.stack([m[2][:, 128] == 0 for m in b]) for b in batches])
        assert (cut[0] & ~cut[1:]).any() and (cut[1] & ~cut[2:]).any()
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(a[:3], b[:3], rtol=1e-5, atol=1e-6)
    for a, b in zip(eager_params, graphed_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert eager[0][0] != eager[-1][0]
