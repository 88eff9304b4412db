"""Checkpoints: canonical per-expert layout, exact round trip of model + optimizer + routing bias, atomic
visibility and pruning. A minimal model following the contract stands in for pith_models' models."""

import pytest
import torch
from pith_engine import checkpoint
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

E, D, F = 4, 6, 5


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.randn(E, D, 2 * F))
        self.w_down = nn.Parameter(torch.randn(E, F, D))


class Layer(nn.Module):
    def __init__(self, moe: bool):
        super().__init__()
        self.norm = nn.Parameter(torch.randn(D))
        self.experts = Experts() if moe else None
        # Non-persistent, as some models register it: the checkpoint must still carry it.
        self.register_buffer("expert_bias", torch.zeros(E), persistent=False)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(False), Layer(True), Layer(True)])
        self.lm_head = nn.Linear(D, 7, bias=False)


def _trained(seed: int) -> tuple[Model, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    for layer in model.layers:
        layer.expert_bias.normal_()
    return model, opt


def test_checkpoint_is_canonical_one_entry_per_expert(tmp_path):
    model, opt = _trained(0)
    assert checkpoint.expert_param_names(model) == {
        f"layers.{i}.experts.{w}" for i in (1, 2) for w in ("w_gate_up", "w_down")
    }
    checkpoint.save(tmp_path / "ckpt", model, opt)
    keys = set(FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata)
    assert {f"model.layers.2.experts.w_down.{e}" for e in range(E)} <= keys
    assert "model.layers.2.experts.w_down" not in keys and "model.layers.0.norm" in keys
    assert "optim.state.layers.1.experts.w_gate_up.3.exp_avg_sq" in keys
    assert "buffers.layers.1.expert_bias" in keys


def test_round_trip_restores_model_optimizer_and_bias_exactly(tmp_path):
    model, opt = _trained(0)
    checkpoint.save(tmp_path / "ckpt", model, opt, files={"note.json": "{}"})
    assert (tmp_path / "ckpt" / "note.json").read_text() == "{}"
    other, other_opt = _trained(1)
    checkpoint.load(tmp_path / "ckpt", other, other_opt)
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(model.buffers(), other.buffers()):
        assert torch.equal(a, b)
    # The optimizer continues identically: same state, same next update.
    for m, o in ((model, opt), (other, other_opt)):
        torch.manual_seed(5)
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        o.step()
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_only_complete_checkpoints_count_and_prune_keeps_the_newest(tmp_path):
    model, _ = _trained(0)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path / f"step_{step:06d}", model)
    (tmp_path / "step_000004.tmp").mkdir()  # a save that was killed before its rename
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_000001", "step_000002", "step_000003"]
    checkpoint.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]
    with pytest.raises(ValueError, match="not a Pith checkpoint"):
        checkpoint.load(tmp_path, model)
