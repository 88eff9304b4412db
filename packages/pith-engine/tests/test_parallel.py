"""Layout checks name the numbers they reject; the global gradient norm and clipping on one process
match a float64 computation. (Multi-process behaviour: test_equivalence.py, test_expert_parallel.py.)"""

import pytest
import torch
from pith_engine.parallel import Layout, Mesh, check_layout, clip_coef, grad_norm

GOOD = dict(world_size=8, num_experts=8, seq_len=16, global_batch=8, micro_batch=1)


def test_a_consistent_layout_passes_and_counts_its_data_ranks():
    layout = Layout(dp=2, cp=2, ep=2)
    check_layout(layout, **GOOD)
    assert (layout.world, layout.data_ranks) == (8, 4)


@pytest.mark.parametrize(
    "layout, change, words",
    [
        (Layout(dp=2, cp=2, ep=2), dict(world_size=6), ["world size 6", "1*2*2*2 = 8"]),
        (Layout(dp=2, ep=4), dict(num_experts=6), ["6 experts", "ep=4"]),
        (Layout(dp=2, cp=4), dict(seq_len=12), ["sequence length 12", "2*cp = 8"]),
        (Layout(dp=2, cp=2, ep=2), dict(global_batch=12, micro_batch=2), ["global batch 12", "2*2*2 = 8"]),
        (Layout(dp=0, cp=2, ep=4), {}, ["dp=0 must be >= 1"]),
    ],
)
def test_a_misconfigured_layout_is_rejected_naming_the_numbers(layout, change, words):
    with pytest.raises(ValueError) as e:
        check_layout(layout, **{**GOOD, **change})
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("max_norm", [0.0, 0.3, 1e9])
def test_grad_norm_and_clipping_on_one_process_match_float64(max_norm):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((3, 4), (5,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) / 4
    grads64 = [p.grad.double().clone() for p in params]
    norm64 = torch.cat([g.flatten() for g in grads64]).norm()
    norm = grad_norm(params, Mesh(Layout(), torch.device("cpu")))
    torch.testing.assert_close(norm.double(), norm64, rtol=1e-6, atol=0)
    scale = min(1.0, max_norm / (norm64.item() + 1e-6)) if max_norm > 0 else 1.0
    assert max_norm != 0.3 or scale < 1  # the middle case does clip
    torch.testing.assert_close(
        clip_coef(norm, max_norm).double(), torch.tensor(scale).double(), rtol=1e-6, atol=0
    )
