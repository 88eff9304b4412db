"""The single-process executor runs a model's stages back to back and equals the model's reference.

A toy model (plain torch, not from pith-models: the engine sits below the models) implements the
contract: a dense layer, then a MoE layer with top-2 routing. Shape legend: B batch, S sequence,
T tokens, D hidden, E experts, K top-k, F expert width, N grouped rows, V vocabulary.
"""

import pytest
import torch
from pith_engine.contract import Positions, Routing, Stage1Out, default_position_ids
from pith_engine.executor import LocalExperts, forward
from pith_ops import grouped_gemm, moe_unpermute
from torch import Tensor, nn

D, E, K, F, V = 8, 3, 2, 5, 11


class ToyLayer(nn.Module):
    experts = None  # the expert weights are the layer's own (no expert sharding, no FP8)

    def __init__(self, moe: bool):
        super().__init__()
        self.mix = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.router = nn.Parameter(torch.randn(D, E)) if moe else None
        self.w_in_EDF = nn.Parameter(torch.randn(E, D, F) / D**0.5) if moe else None
        self.w_out_EFD = nn.Parameter(torch.randn(E, F, D) / F**0.5) if moe else None

    def stage1(self, h_BSD: Tensor, pos: Positions) -> Stage1Out:
        h_BSD = h_BSD + torch.tanh(h_BSD @ self.mix)  # stands in for attention
        if self.router is None:
            return Stage1Out(h_BSD + torch.sin(h_BSD), None)
        x_TD = h_BSD.flatten(0, 1)
        logits_TE = x_TD @ self.router
        probs_TE = logits_TE.softmax(-1)
        weights_TK, expert_ids_TK = probs_TE.topk(K, dim=-1)
        return Stage1Out(h_BSD, Routing(x_TD, expert_ids_TK, weights_TK, probs_TE, logits_TE))

    def stage3(self, x_ND: Tensor, group_ends_E: Tensor) -> Tensor:
        return grouped_gemm(
            torch.relu(grouped_gemm(x_ND, self.w_in_EDF, group_ends_E)), self.w_out_EFD, group_ends_E
        )

    def stage5(self, h_BSD: Tensor, y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor:
        return h_BSD + moe_unpermute(y_ND, slots_TK, weights_TK).view_as(h_BSD)

    def reference_forward(self, h_BSD: Tensor, pos: Positions) -> Tensor:
        s1 = self.stage1(h_BSD, pos)
        if s1.routing is None:
            return s1.h_BSD
        r = s1.routing
        out_TD = torch.zeros_like(r.x_TD)
        for t in range(r.x_TD.shape[0]):
            for k in range(K):
                e = r.expert_ids_TK[t, k]
                out_TD[t] += r.weights_TK[t, k] * (
                    torch.relu(r.x_TD[t] @ self.w_in_EDF[e]) @ self.w_out_EFD[e]
                )
        return s1.h_BSD + out_TD.view_as(h_BSD)


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({"0": ToyLayer(False), "1": ToyLayer(True)})
        self.lm_head = nn.Linear(D, V, bias=False)

    def prologue(self, input_ids_BS):
        return self.embed(input_ids_BS)

    def positions(self, position_ids_BS, cp_group=None):
        return Positions(position_ids_BS, None, None, cp_group)

    def epilogue(self, h_BSD):
        return torch.nn.functional.rms_norm(h_BSD, (D,))

    def reference_forward(self, input_ids_BS):
        pos = self.positions(default_position_ids(input_ids_BS))
        h_BSD = self.prologue(input_ids_BS)
        for layer in self.layers.values():
            h_BSD = layer.reference_forward(h_BSD, pos)
        return self.lm_head(self.epilogue(h_BSD))


class PreWeightedCombine(LocalExperts):
    """A combine that sums each token's expert rows itself and hands stage 5 one row per token
    (slot t, weight 1) and -1 slots for the rest: the form an EP engine may use."""

    def combine(self, y_ND, handle, seg=None):
        yield from ()  # no exchange
        slots_TK, weights_TK = handle
        rows_TD = (y_ND[slots_TK] * weights_TK[..., None]).sum(1)
        T = slots_TK.shape[0]
        slots = torch.full_like(slots_TK, -1)
        slots[:, 0] = torch.arange(T)
        return rows_TD, slots, torch.ones_like(weights_TK)


@pytest.mark.parametrize(
    "comm",
    [LocalExperts(), LocalExperts(align=4), PreWeightedCombine()],
    ids=["local", "padded", "preweighted"],
)
def test_staged_forward_and_grads_equal_the_reference(comm):
    model = ToyModel()
    ids_BS = torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(1))
    h_BSD, routings = forward(model, ids_BS, comm)
    assert len(routings) == 1  # the dense layer hands no routing
    logits_BSV = model.lm_head(h_BSD)
    expected_BSV = model.reference_forward(ids_BS)
    torch.testing.assert_close(logits_BSV, expected_BSV, rtol=1e-5, atol=1e-6)
    params = list(model.parameters())
    got = torch.autograd.grad(logits_BSV.square().sum(), params)
    want = torch.autograd.grad(expected_BSV.square().sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_a_seed_that_needs_no_gradient_never_reaches_an_output_made_after_it_was_freed():
    """A loss term that needs no gradient (the aux losses off) seeded, then freed: CPython hands its
    address to a later tensor, often a stage output. The tape's bookkeeping must not confuse the two
    (it once keyed seeds by id() without keeping them alive: a stale gradient 1 or a crash)."""
    from pith_engine.executor import Tape, drain

    for _ in range(50):
        tape = Tape()
        x = torch.ones(3, requires_grad=True)
        stale = torch.zeros(())
        tape.seed(stale)
        address = id(stale)
        del stale
        outs = [tape(lambda t: t * 2.0, x)]
        while len(outs) < 50 and id(outs[-1]) != address:
            outs.append(tape(lambda t: t * 2.0, x))
        tape.seed(outs[0], torch.ones(3))  # only the first output carries a gradient
        drain(tape.backward())
        assert torch.equal(tape.grad(x), torch.full((3,), 2.0))
