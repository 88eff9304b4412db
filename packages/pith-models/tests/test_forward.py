"""model(input_ids) returns logits for every family (the staged path, equal to reference_forward).

Shape legend: B batch, S sequence, V vocabulary.
"""

import pith_models
import pith_ops
import pytest
import torch
from pith_engine.executor import LocalExperts, forward
from pith_engine.fp8 import use_fp8
from pith_ops import linear_cross_entropy

pytestmark = pytest.mark.usefixtures("ops_take_their_torch_path")  # see conftest.py


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v2-tiny", "gpt-oss-tiny"])
def test_calling_the_model_gives_the_reference_logits(name):
    model = pith_models.build(name, "cpu", seed=0)
    ids_BS = torch.randint(0, model.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    logits_BSV = model(ids_BS)
    assert logits_BSV.shape == (2, 7, model.cfg.vocab_size)
    torch.testing.assert_close(logits_BSV, model.reference_forward(ids_BS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v2-tiny", "gpt-oss-tiny"])
def test_fp8_experts_take_rows_dispatched_in_fp8_as_the_rows_their_gemms_would_quantise(name, monkeypatch):
    """use_fp8: stage 2 hands every family's experts pith_ops.FP8Rows (the rows quantised once per
    token); given the plain rows instead, the expert GEMMs quantise them into the same e4m3 rows: the
    same loss, and the same gradients to fp32 summation order (the stand-in's backward sums a token's
    copies in another order than the plain permutation's reference)."""
    model = pith_models.build(name, "cpu", seed=0)
    use_fp8(model)
    ids_BS = torch.randint(0, model.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    labels_T, params = ids_BS.roll(-1, 1).flatten(), list(model.parameters())

    def loss_and_grads():
        h_BSD, _ = forward(model, ids_BS, LocalExperts())
        loss = linear_cross_entropy(h_BSD.flatten(0, 1), model.lm_head.weight, labels_T)
        return [loss, *torch.autograd.grad(loss, params)]

    dispatched, fp8_rows = [], pith_ops.fp8_rows
    monkeypatch.setattr(pith_ops, "fp8_rows", lambda x: dispatched.append(x.shape) or fp8_rows(x))
    fp8 = loss_and_grads()
    assert dispatched, "no rows were dispatched in FP8"
    monkeypatch.setattr(pith_ops, "fp8_rows", lambda x: x)
    for got, want in zip(fp8, loss_and_grads(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v2-tiny", "gpt-oss-tiny"])
def test_bf16_weights_route_in_fp32_and_track_the_fp32_reference(name):
    """A model converted to bf16 (eval, generate, the bf16 gpu tests) runs model(ids) and the staged
    forward and backward: its routers compute fp32 logits from the bf16 weights (the weights' values
    in fp32, not bf16 products), the loss stays within 2% of the fp32 model's reference loss (bf16
    may flip a near-tied routing choice), and every parameter gets a finite gradient."""
    model = pith_models.build(name, "cpu", seed=0)
    ids_BS = torch.randint(0, model.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    labels_T = ids_BS.roll(-1, 1).flatten()
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model.reference_forward(ids_BS).flatten(0, 1), labels_T)
    model = model.to(torch.bfloat16)
    assert model(ids_BS).dtype == torch.bfloat16
    h_BSD, routings = forward(model, ids_BS, LocalExperts())
    routers = [layer.router for layer in model.layers.values() if layer.router is not None]
    assert len(routings) == len(routers) > 0
    for r, router in zip(routings, routers):
        assert r.logits_TE.dtype == torch.float32
        bias_E = 0 if router.bias is None else router.bias.double()
        expected_TE = r.x_TD.double() @ router.weight.double().T + bias_E
        torch.testing.assert_close(r.logits_TE.double(), expected_TE, rtol=1e-5, atol=1e-6)
    loss = linear_cross_entropy(h_BSD.flatten(0, 1), model.lm_head.weight, labels_T)
    assert abs(loss.item() - expected.item()) <= 2e-2 * expected.item()
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
