"""The training step on one process: stage-level segments driven by the pp=1 schedule give bit for bit
the losses and gradients of one autograd graph per micro-batch (the step before the pipeline
executor), for Qwen3-MoE (a dense and a MoE layer), DeepSeek-V2 (shared experts, a dense first layer)
and GPT-OSS, with the load-balancing loss and the z-loss on; the aux losses and the bias update
match their definitions."""

import copy
import dataclasses
import math

import pytest
import torch
from pith_engine import executor
from pith_engine.contract import Routing
from pith_engine.parallel import Layout, Mesh
from pith_engine.step import Aux, Stages, layer_aux, loss_sum, train_step, update_expert_bias
from pith_models import deepseek_v2, gpt_oss, qwen3_moe

MODELS = {
    "qwen3_moe": (qwen3_moe, qwen3_moe.TINY),
    "deepseek_v2": (deepseek_v2, dataclasses.replace(deepseek_v2.TINY, num_hidden_layers=2)),
    "gpt_oss": (gpt_oss, dataclasses.replace(gpt_oss.TINY, num_hidden_layers=2, layer_types=())),
}
SINGLE = Mesh(Layout(), torch.device("cpu"))
pytestmark = pytest.mark.usefixtures("reference_ops")  # the step is the subject, not the kernels
LBL, Z = 0.3, 0.01


def _micro(vocab: int, M: int, B: int = 2, S: int = 8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (M, B, S), generator=g)
    labels = torch.randint(0, vocab, (M, B, S), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
    return list(zip(ids, labels))


def _reference_grads(model, micro, moe_layers: int):
    """The step as it was: one autograd graph per micro-batch, aux terms over all layers at once."""
    label_tokens = sum(int((y != -100).sum()) for _, y in micro)
    M, tokens, ce_sum = len(micro), micro[0][0].numel(), torch.zeros(())
    for ids, labels in micro:
        h_BSD, routings = executor.forward(model, ids, executor.LocalExperts())
        ce = loss_sum(h_BSD, model.lm_head, labels.flatten())
        counts_LE = torch.stack(
            [torch.bincount(r.expert_ids_TK.flatten(), minlength=r.probs_TE.shape[1]) for r in routings]
        ).float()
        lbl = z = torch.zeros(())
        for r, counts_E in zip(routings, counts_LE):
            E, K = r.probs_TE.shape[1], r.expert_ids_TK.shape[1]
            lbl = lbl + E * (counts_E / (tokens * K) * r.probs_TE.sum(0) / tokens).sum()
            z = z + (torch.logsumexp(r.logits_TE.float(), dim=-1) ** 2).sum() / tokens
        aux = (LBL * lbl + Z * z) / max(1, len(routings))
        assert len(routings) == moe_layers
        (ce.float() / label_tokens + aux / M).backward()
        ce_sum += ce.detach().float()
    return (ce_sum / label_tokens).item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", MODELS)
def test_the_staged_step_is_bit_for_bit_one_graph_per_micro_batch(name, scaled_adamw):
    M = 3  # micro-batches (one is what most other tests run)
    module, cfg = MODELS[name]
    model = module.Model(cfg)
    module.init_weights(model, seed=0)
    with torch.no_grad():  # away from init's uniform routing, so every parameter's use shows
        g = torch.Generator().manual_seed(2)
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    ref = copy.deepcopy(model)
    micro = _micro(cfg.vocab_size, M)
    moe_layers = sum(layer.experts is not None for layer in model.layers.values())
    want_loss, want = _reference_grads(ref, micro, moe_layers)

    got = {}
    opt = scaled_adamw(model.parameters(), lr=0.0)
    # Before the update: the step's gradients, complete.
    opt.register_step_pre_hook(
        lambda *_: got.update({n: p.grad.clone() for n, p in model.named_parameters()})
    )
    r = train_step(Stages(model, SINGLE), opt, micro, 0.0, Aux(LBL, Z, moe_layers), 0.0, 0.0)
    assert r.loss.item() == want_loss
    assert got.keys() == want.keys()
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    assert not differ, f"gradients not bit for bit: {differ}"
    assert all(want[n].abs().sum() > 0 for n in want)  # every parameter got a gradient


def _routing(T: int, E: int, K: int, seed: int) -> Routing:
    g = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(T, E, generator=g, dtype=torch.float64)
    probs_TE = logits_TE.softmax(-1)
    ids_TK = probs_TE.topk(K, -1).indices
    return Routing(torch.zeros(T, 1), ids_TK, probs_TE.gather(1, ids_TK), probs_TE, logits_TE)


def test_aux_losses_match_their_definitions():
    T, E, K, layers, M = 12, 5, 2, 3, 2
    r = _routing(T, E, K, 0)
    aux, counts_E = layer_aux(r, Aux(0.3, 0.2, layers, M), T, SINGLE)
    f = [float((r.expert_ids_TK == e).sum()) / (T * K) for e in range(E)]
    P = [float(r.probs_TE[:, e].sum()) / T for e in range(E)]
    lbl = E * sum(fe * pe for fe, pe in zip(f, P))
    z = sum(float(torch.logsumexp(row, 0)) ** 2 for row in r.logits_TE) / T
    assert math.isclose(float(aux), (0.3 * lbl + 0.2 * z) / layers / M, rel_tol=1e-6)
    assert counts_E.tolist() == [float((r.expert_ids_TK == e).sum()) for e in range(E)]
    # Two data ranks, each with half the tokens, divide by the whole micro-batch's token count: their
    # z-loss shares add up to the whole (the load-balancing part also needs the all-reduced counts,
    # which the multi-process tests cover).
    halves = [Routing(*(t[sl] for t in r)) for sl in (slice(0, T // 2), slice(T // 2, T))]
    z_only = Aux(0.0, 1.0)
    parts = sum(float(layer_aux(h, z_only, T, SINGLE)[0]) for h in halves)
    assert math.isclose(float(layer_aux(r, z_only, T, SINGLE)[0]), parts, rel_tol=1e-6)


def test_load_balancing_gradient_matches_its_float64_formula():
    """The router logits' gradient of the load-balancing loss (the loads f_e count top-k choices, so
    they carry none): with g_e = coef * E * f_e / (T * layers * M),
    d/dlogit_tj = p_tj (g_j - sum_e p_te g_e)."""
    T, E, K, layers, M, coef = 12, 5, 2, 3, 2, 0.3
    r = _routing(T, E, K, 1)
    logits_TE = r.logits_TE.clone().requires_grad_()
    probs_TE = logits_TE.softmax(-1)
    r_grad = r._replace(probs_TE=probs_TE, logits_TE=logits_TE)
    layer_aux(r_grad, Aux(coef, 0.0, layers, M), T, SINGLE)[0].backward()
    f_E = torch.stack([(r.expert_ids_TK == e).sum() for e in range(E)]).double() / (T * K)
    g_E = coef * E * f_E / (T * layers * M)
    p_TE = r.probs_TE
    want_TE = p_TE * (g_E - (p_TE * g_E).sum(-1, keepdim=True))
    # the counts are float32 in layer_aux: 1e-7 relative, cancelling in the bracket
    torch.testing.assert_close(logits_TE.grad, want_TE, rtol=1e-6, atol=1e-6 * float(want_TE.abs().max()))


def test_expert_bias_moves_toward_balance():
    bias = torch.zeros(4)
    update_expert_bias({3: bias}, {3: torch.tensor([10.0, 2.0, 4.0, 0.0])}, rate=0.01)
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
