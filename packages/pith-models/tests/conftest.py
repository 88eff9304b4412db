"""Checks every model family's tests run the same way, handed out as fixtures (the tests run under
pytest's importlib mode, where a test file cannot import a helper module beside it).

Shape legend: B batch, S sequence, T tokens, V vocabulary, D hidden.
"""

import pith_models
import pith_ops._common
import pytest
import torch
from pith_engine.executor import LocalExperts, forward
from pith_ops import linear_cross_entropy


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def ops_take_their_torch_path(monkeypatch):
    """The Triton interpreter would take minutes on the larger model tests; pith-ops tests its
    kernels, and the gpu tests run the models through them."""
    monkeypatch.setattr(pith_ops._common, "INTERPRET", False)


def _staged_grads_equal_reference(model, ids_BS):
    """Every parameter gets a finite, nonzero gradient from the staged path (fused loss) equal to the
    reference forward's."""
    labels_T = ids_BS.roll(-1, 1).flatten()
    h_BSD, _ = forward(model, ids_BS, LocalExperts())
    loss = linear_cross_entropy(h_BSD.flatten(0, 1), model.lm_head.weight, labels_T)
    staged = torch.autograd.grad(loss, list(model.parameters()))
    ref_loss = torch.nn.functional.cross_entropy(model.reference_forward(ids_BS).flatten(0, 1), labels_T)
    reference = torch.autograd.grad(ref_loss, list(model.parameters()))
    for (name, _), g, g_ref in zip(model.named_parameters(), staged, reference):
        assert torch.isfinite(g).all() and g.abs().sum() > 0, name
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture
def staged_grads_equal_reference():
    return _staged_grads_equal_reference


def _hf_round_trip(hf, cfg, tmp_path, S):
    """transformers model `hf` -> save -> pith_models.from_pretrained (config equal, reference and
    staged logits within 1e-4 of transformers') -> save_pretrained -> transformers again (the same
    logits). -> the imported model."""
    hf.save_pretrained(tmp_path / "hf")
    model = pith_models.from_pretrained(tmp_path / "hf")
    assert model.cfg == cfg
    ids_BS = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf_BSV = hf(ids_BS).logits
        ours_BSV = model.reference_forward(ids_BS)
        staged_BSV = model.lm_head(forward(model, ids_BS, LocalExperts())[0])
    assert rel_err(ours_BSV, hf_BSV) <= 1e-4
    assert rel_err(staged_BSV, hf_BSV) <= 1e-4
    pith_models.save_pretrained(model, tmp_path / "ours", dtype=torch.float32)
    back = type(hf).from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        assert rel_err(back(ids_BS).logits, hf_BSV) <= 1e-4
    return model


@pytest.fixture
def hf_round_trip():
    return _hf_round_trip


def _kernels_match_reference_on_gpu(model, ids_BS, dtype, tol):
    """The staged path through pith-ops' Triton kernels on CUDA, in `dtype`, gives the reference's
    fp32 loss within tol (relative; the loss, not the logits: a near-tie in routing may flip under
    bf16 or TF32 rounding), and finite, nonzero gradients."""
    model, ids_BS = model.cuda(), ids_BS.cuda()
    labels_T = ids_BS.roll(-1, 1).flatten()
    ref_loss = torch.nn.functional.cross_entropy(model.reference_forward(ids_BS).flatten(0, 1), labels_T)
    model = model.to(dtype)
    h_BSD, _ = forward(model, ids_BS, LocalExperts(align=16))
    loss = linear_cross_entropy(h_BSD.flatten(0, 1), model.lm_head.weight, labels_T)
    assert abs(loss.item() - ref_loss.item()) <= tol * ref_loss.item()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.fixture
def kernels_match_reference_on_gpu():
    return _kernels_match_reference_on_gpu
