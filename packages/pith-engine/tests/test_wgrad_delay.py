"""Weight-gradient delay: Linear and Experts with a WeightGradQueue give bit-for-bit the gradients of
the plain modules, whether the weight-gradient work runs inside the backward or later from the queue,
over two accumulated micro-batches; deferred work leaves .grad untouched until it runs; under
torch.compile the queue is bypassed and the result is unchanged. The same holds in FP8 (use_fp8), whose
weights the optimizer steps are quantised once, on their first forward, and then by the update pass,
bit-identical to quantising on every call where the scales agree.

Shape legend: B batch, S sequence, D in features, O out features, N grouped rows, E experts, F expert
hidden width.
"""

import collections
import contextlib
import copy

import pith_models
import pith_ops
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_engine import layers
from pith_engine.fp8 import FP8Switch, use_fp8
from pith_engine.layers import Linear
from pith_engine.parallel import Layout, Mesh
from pith_engine.step import Aux, Stages, train_step
from pith_engine.wgrad import WeightGradQueue, set_wgrad_queue
from pith_models import qwen3_moe
from pith_models.qwen3_moe import Experts
from pith_ops import _common, quantize_weight


def _grads(module, batches, queue, defer):
    """Forward + backward of each micro-batch; with `defer`, each backward inside queue.deferring() and
    its weight-gradient work run after the next micro-batch's backward (as a schedule's W slots do)."""
    set_wgrad_queue(module, queue)
    input_grads = []
    for i, (inputs, dy) in enumerate(batches):
        leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = module(*leaves)
        if defer:
            with queue.deferring():
                out.backward(dy)
            assert len(queue) == 1 + (i > 0)
            if i == 0:  # nothing of this backward's weight work has run yet
                assert all(p.grad is None for p in module.parameters())
            if i > 0:
                queue.run_next()
        else:
            out.backward(dy)
        input_grads.append(leaves[0].grad)
    queue.run_all() if queue is not None else None
    return input_grads, [p.grad for p in module.parameters()]


def _check_all_ways_equal(module, batches):
    want = _grads(copy.deepcopy(module), batches, None, False)
    for defer in (False, True):
        got = _grads(copy.deepcopy(module), batches, WeightGradQueue(), defer)
        for a, b in zip(want[0] + want[1], got[0] + got[1], strict=True):
            assert torch.equal(a, b), (defer, (a - b).abs().max())


@given(
    lead=st.sampled_from([(0,), (3,), (2, 5), (1, 1)]),
    D=st.integers(1, 17),
    O=st.integers(1, 17),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_deferred_weight_grads_equal_the_plain_backward_bit_for_bit(lead, D, O, bias, seed):
    torch.manual_seed(seed)
    module = Linear(D, O, bias)
    batches = [((torch.randn(*lead, D),), torch.randn(*lead, O)) for _ in range(2)]
    _check_all_ways_equal(module, batches)


@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    tail=st.integers(0, 3),
    D=st.integers(1, 12),
    F=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    kernel=st.booleans(),
)
def test_experts_deferred_weight_grads_equal_the_plain_backward_bit_for_bit(sizes, tail, D, F, seed, kernel):
    """kernel: the grouped-GEMM Triton kernels (interpreted on CPU), else their reference."""
    torch.manual_seed(seed)
    module = Experts(len(sizes), D, F)
    torch.nn.init.normal_(module.w_gate_up)
    torch.nn.init.normal_(module.w_down)
    ends_E = torch.tensor(sizes).cumsum(0).to(torch.int32)
    N = sum(sizes) + tail
    batches = [((torch.randn(N, D), ends_E), torch.randn(N, D)) for _ in range(2)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_common, "INTERPRET", False)
        _check_all_ways_equal(module, batches)


def test_deferred_weight_grads_flow_through_the_weights_dtype_cast():
    """fp16 rows meet fp32 weights (Experts casts them): the queue's work reaches the fp32 .grad."""
    torch.manual_seed(0)
    module = Experts(3, 8, 4)
    torch.nn.init.normal_(module.w_gate_up, std=0.3)
    torch.nn.init.normal_(module.w_down, std=0.3)
    ends_E = torch.tensor([2, 2, 7], dtype=torch.int32)
    batches = [((torch.randn(9, 8).half(), ends_E), torch.randn(9, 8).half())]
    _check_all_ways_equal(module, batches)
    assert module.w_gate_up.grad is None  # the checks ran on copies


@pytest.mark.parametrize("kept", [False, True])
def test_linear_under_bf16_autocast_defers_the_plain_backward_bit_for_bit(kept):
    """Under bf16 autocast (the trainer's CUDA forward; here CPU's) a queued Linear runs its GEMMs on
    the bf16 casts of its fp32 weights, as autocast does, and its weights get the gradients of the
    plain module (widened to fp32, or held in bf16 for an optimizer that keeps them: pith_ops.cast)."""
    torch.manual_seed(0)
    module = Linear(24, 40, bias=True)
    x, dy = torch.randn(2, 5, 24), torch.randn(2, 5, 40).bfloat16()
    got = []
    for queue in (None, WeightGradQueue()):
        m = copy.deepcopy(module)
        set_wgrad_queue(m, queue)
        if kept:
            pith_ops.keep_grads(m.parameters())
        x_leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            y = m(x_leaf)
        assert y.dtype == torch.bfloat16
        if queue is None:
            y.backward(dy)
        else:
            with queue.deferring():
                y.backward(dy)
            assert all(p.grad is None and pith_ops.grad(p) is None for p in m.parameters())
            queue.run_all()
        got.append([y, x_leaf.grad, *(pith_ops.grad(p) for p in m.parameters())])
    plain, queued = got
    for a, b in zip(plain, queued, strict=True):
        assert torch.equal(a.float(), b.float())
    if kept:  # held in bf16 (the plain module's autocast cast widens them into .grad)
        assert all(g.dtype == torch.bfloat16 for g in queued[2:])


def _compiled_with_a_queue(module, x, dy):
    """(module's grads eager, a queued copy's grads compiled to one graph): under torch.compile the
    queue is bypassed, the weight grads computed at once."""
    queue, compiled = WeightGradQueue(), copy.deepcopy(module)
    set_wgrad_queue(compiled, queue)
    module(x).backward(dy)
    with queue.deferring():
        torch.compile(compiled, backend="aot_eager", fullgraph=True)(x).backward(dy)
    queue.run_all()
    return zip(module.parameters(), compiled.parameters(), strict=True)


def test_linear_with_a_queue_compiles_to_one_graph_and_computes_weight_grads_at_once():
    torch.manual_seed(0)
    for a, b in _compiled_with_a_queue(Linear(6, 5), torch.randn(2, 3, 6), torch.randn(2, 3, 5)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def _fp8_modules(seed: int) -> tuple[Linear, Experts]:
    torch.manual_seed(seed)
    lin, experts = Linear(24, 40, bias=True), Experts(3, 16, 8)
    torch.nn.init.normal_(experts.w_gate_up, std=0.3)
    torch.nn.init.normal_(experts.w_down, std=0.3)
    use_fp8(lin)
    use_fp8(experts)
    return lin, experts


def test_fp8_deferred_weight_grads_equal_the_plain_backward_bit_for_bit():
    """The quantisation's references (the interpreted kernels take 4x longer; pith-ops tests them)."""
    lin, experts = _fp8_modules(0)
    ends_E = torch.tensor([4, 4, 11], dtype=torch.int32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_common, "INTERPRET", False)
        _check_all_ways_equal(lin, [((torch.randn(2, 5, 24),), torch.randn(2, 5, 40)) for _ in range(2)])
        batches = [((torch.randn(13, 16), ends_E), torch.randn(13, 16)) for _ in range(2)]
        _check_all_ways_equal(experts, batches)


def _train(modules, kept: bool, steps=2, micro=3):
    """`steps` AdamW steps (pith_ops.adamw_, as pith-train's AdamW: it marks its weights, reads their
    kept gradients and rewrites their kept copies) of `micro` micro-batches each -> (every
    micro-batch's outputs, final weights, each weight's FP8 scale at the last forward)."""
    modules = copy.deepcopy(modules)
    lin, experts = modules
    params = [p for m in modules for p in m.parameters()]
    if kept:
        pith_ops.keep_grads(params)
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    g = torch.Generator().manual_seed(1)
    ends_E = torch.tensor([5, 5, 12], dtype=torch.int32)
    outs = []
    for step in range(1, steps + 1):
        for _ in range(micro):
            y = lin(torch.randn(4, 24, generator=g))
            z = experts(torch.randn(12, 16, generator=g), ends_E)
            (y.square().sum() + z.square().sum()).backward()
            outs += [y.detach(), z.detach()]
        scales = [FP8Switch.fp8_weight(w, quantize_weight)[1].flatten()[0] for w in params if w.ndim > 1]
        with torch.no_grad():
            for p, (m, v) in zip(params, state):
                pith_ops.adamw_(p, pith_ops.grad(p), m, v, torch.ones(1), lr=1e-3, beta1=0.9, beta2=0.95,
                                weight_decay=0.0, eps=1e-8, step=step,
                                fp8=pith_ops.kept_copy(p, torch.float8_e4m3fn))  # fmt: skip
                p.grad = None
                pith_ops.drop_grad(p)
    return outs, [p.detach().clone() for p in params], scales


def test_fp8_weights_quantised_once_then_by_the_update_equal_per_call_quantisation():
    """Weights the optimizer marks keep their FP8 copies from their first forward on: the
    micro-batches and steps after read what adamw_ wrote (delayed scaling: the scale of the weights
    before the update; here no amax crossed a power of two, so the same scales as quantising per
    call) and their bf16 gradients stay bf16 (pith_ops.cast's kept gradients): bit for bit the run
    that quantises every call and widens every gradient."""
    modules = _fp8_modules(1)
    calls = {}

    def counting(quantize):
        def run(w):
            calls[id(w)] = calls.get(id(w), 0) + 1
            return quantize(w)

        return run

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            _common, "INTERPRET", False
        )  # the quantisation's references: the kernels are tested in pith-ops
        for name in ("fp8_linear_weight", "fp8_grouped_gemm_weight"):
            patch.setattr(layers, name, counting(getattr(layers, name)))
        want = _train(modules, kept=False)
        assert sorted(calls.values()) == [6, 6, 6]  # 2 steps x 3 micro-batches, each weight
        calls.clear()
        got = _train(modules, kept=True)
        assert sorted(calls.values()) == [1, 1, 1]  # the first forward; adamw_ writes the rest
    assert all(torch.equal(a, b) for a, b in zip(want[2], got[2], strict=True))
    for a, b in zip(want[0] + want[1], got[0] + got[1], strict=True):
        assert torch.equal(a, b)


def test_fp8_linear_with_a_queue_compiles_to_one_graph_and_equals_eager():
    """Under torch.compile the weight quantisation is a graph node (no cache) and the queue is bypassed:
    the same values as eager."""
    lin, _ = _fp8_modules(2)
    for a, b in _compiled_with_a_queue(lin, torch.randn(2, 3, 24), torch.randn(2, 3, 40)):
        assert torch.equal(a.grad, b.grad)


def _attention_calls_and_grads(model, ac: str, micro):
    """One train_step (pp=1, the weight-gradient queue on) -> (attention forwards per layer, losses,
    the gradients)."""
    model = copy.deepcopy(model)
    calls = collections.Counter()
    for i, layer in model.layers.items():
        layer.self_attn.register_forward_hook(lambda *_, i=i: calls.update([i]))
    grads = {}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.step = lambda grad_scale=None: grads.update({n: p.grad for n, p in model.named_parameters()})
    stages = Stages(model, Mesh(Layout(), torch.device("cpu")), ac=ac, wgrad=True)
    r = train_step(stages, opt, micro, 0.0, Aux(), 0.0, 0.0)
    return dict(calls), r.loss, grads


def test_full_checkpointing_with_the_queue_recomputes_each_stage_once(reference_ops):
    """ac=full with deferred weight gradients: one recompute of stage 1 per micro-batch serves its
    input gradient and, later, its weight gradients (2 attention calls per layer and micro-batch, the
    forward and the recompute), and the gradients are those of ac=none."""
    model = pith_models.build(qwen3_moe.TINY, "cpu", seed=0)
    g = torch.Generator().manual_seed(0)
    micro = [tuple(torch.randint(0, qwen3_moe.TINY.vocab_size, (2, 8), generator=g) for _ in "xy")] * 4
    none_calls, none_loss, none_grads = _attention_calls_and_grads(model, "none", micro)
    full_calls, full_loss, full_grads = _attention_calls_and_grads(model, "full", micro)
    assert none_calls == {i: 4 for i in model.layers}
    assert full_calls == {i: 8 for i in model.layers}
    assert torch.equal(full_loss, none_loss)
    for n, want in none_grads.items():
        assert torch.equal(full_grads[n], want), n


@pytest.mark.parametrize("deferred", [False, True])
def test_fp8_weight_grads_are_held_in_bf16_like_the_bf16_paths(deferred):
    """FP8 projections and experts over bf16 rows (the trainer's CUDA step; here CPU's references) hand
    their fp32 master weights the bf16 weight gradients to hold (pith_ops.weight_grad), as the bf16
    GEMMs' casts do, with or without a queue: widening them into .grad cost the optimizer a widening
    pass and wider reads (FP8 + FP8 lm_head on an H100 lost 6.6% of tokens/s that way)."""
    lin, experts = _fp8_modules(0)
    params = [*lin.parameters(), *experts.parameters()]
    pith_ops.keep_grads(params)
    queue = WeightGradQueue() if deferred else None
    for m in (lin, experts):
        set_wgrad_queue(m, queue)
    ends_E = torch.tensor([5, 5, 12], dtype=torch.int32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_common, "INTERPRET", False)
        y = lin(torch.randn(4, 24).bfloat16())
        z = experts(torch.randn(12, 16).bfloat16(), ends_E)
        with queue.deferring() if deferred else contextlib.nullcontext():
            (y.float().square().sum() + z.float().square().sum()).backward()
        if deferred:
            queue.run_all()
    weights = [lin.weight, experts.w_gate_up, experts.w_down]
    assert [(w.grad, pith_ops.grad(w).dtype) for w in weights] == [(None, torch.bfloat16)] * 3
