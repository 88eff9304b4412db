"""Checkpoints: canonical per-expert layout, exact round trip of model + optimizer + routing bias, atomic
visibility and pruning. A minimal model following the contract stands in for pith_models' models."""

import json
from pathlib import Path

import pith_ops
import pytest
import torch
from pith_engine import checkpoint
from pith_engine.fp8 import use_fp8
from pith_engine.layers import Linear
from pith_models import qwen3_moe
from pith_ops.fp8_quant import FP8Weight, quantize_weight, weight_amax
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
        self.layers = nn.ModuleDict({str(i): Layer(i > 0) for i in range(3)})
        self.lm_head = nn.Linear(D, 7, bias=False)


def _trained(seed: int) -> tuple[Model, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    for layer in model.layers.values():
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


class FP8Model(nn.Module):
    """FP8 weights of both kinds: stacked experts (one scale each) and a Linear."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleDict({"0": nn.Module()})
        self.layers["0"].experts = qwen3_moe.Experts(E, D, F)
        for p in self.layers["0"].experts.parameters():
            nn.init.normal_(p)
        self.lm_head = Linear(D, 7, bias=False)
        use_fp8(self, lm_head=True)
        pith_ops.keep_grads(self.parameters())  # as pith-train's optimizers: their FP8 copies are kept


def _kept(model: nn.Module) -> list:
    return [pith_ops.kept_copy(p, torch.float8_e4m3fn) for p in model.parameters()]


def test_fp8_copies_with_their_delayed_scales_round_trip_exactly(tmp_path):
    """A weight's kept FP8 copies carry the scale of its values before the last update (delayed
    scaling: here each amax 3x its own, one power of two up or more): the checkpoint keeps one scale per
    weight and per expert, and loading requantises the loaded weights with them, bit for bit. A model
    whose optimizer keeps no copies loads none; a checkpoint without scales loads into one that would."""
    model = FP8Model(0)
    for p in model.parameters():
        amax = weight_amax(p) * 3
        pith_ops.keep(p, FP8Weight(*quantize_weight(p.detach(), amax), weight_amax(p)), torch.float8_e4m3fn)
    checkpoint.save(tmp_path / "ckpt", model)
    keys = set(FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata)
    assert {k for k in keys if k.startswith("fp8_scale.")} == {
        "fp8_scale.lm_head.weight",
        *(f"fp8_scale.layers.0.experts.{w}.{e}" for w in ("w_gate_up", "w_down") for e in range(E)),
    }
    other = FP8Model(1)
    checkpoint.load(tmp_path / "ckpt", other)
    for p, want, got in zip(other.parameters(), _kept(model), _kept(other), strict=True):
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(want, got, strict=True))
        assert not torch.equal(got.scale_rows, quantize_weight(p.detach())[1])  # not the own amax's
    unmarked = FP8Model(1)
    for p in unmarked.parameters():
        del p._pith_keep_grad
    checkpoint.load(tmp_path / "ckpt", unmarked)
    assert _kept(unmarked) == [None] * 3
    checkpoint.save(tmp_path / "none", unmarked)
    fresh = FP8Model(2)
    checkpoint.load(tmp_path / "none", fresh)
    assert _kept(fresh) == [None] * 3


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


def test_prune_removes_damaged_checkpoints_older_than_the_kept_ones(tmp_path):
    for name in ("step_000001.damaged", "step_000002", "step_000003.damaged", "step_000004", "step_000005"):
        (tmp_path / name).mkdir()
    checkpoint.prune(tmp_path, keep=2)  # a damaged one newer than the oldest kept stays, to be looked at
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000005"]
    (tmp_path / "step_000006.damaged").mkdir()
    checkpoint.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000005", "step_000006.damaged"]


def _flip_a_byte(f) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def test_manifest_catches_changed_truncated_and_missing_files_before_loading(tmp_path):
    model, opt = _trained(0)
    path = checkpoint.save(tmp_path / "ckpt", model, opt, files={"trainer.json": '{"step": 1}'})
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert {".metadata", "rng.0.pt", "trainer.json"} <= set(manifest)
    assert checkpoint.problem(path) is None
    data = next(path.glob("*.distcp"))
    other, _ = _trained(1)
    before = [p.clone() for p in other.parameters()]
    _flip_a_byte(data)  # e.g. NaN bytes written over a weight: DCP itself would load it silently
    with pytest.raises(checkpoint.CorruptCheckpoint, match=f"{data.name} does not match its SHA-256"):
        checkpoint.load(path, other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # nothing was read
    (path / "trainer.json").write_text('{"step": ')
    assert "trainer.json has 9 bytes, the manifest says 11" in checkpoint.problem(path)
    (path / "rng.0.pt").unlink()
    assert "rng.0.pt is missing" in checkpoint.problem(path)
    (path / "manifest.json").unlink()
    assert "manifest.json is missing" in checkpoint.problem(path)


def test_latest_intact_falls_back_past_a_damaged_checkpoint_and_moves_it_aside(tmp_path):
    model, _ = _trained(0)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path / f"step_{step:06d}", model)
    _flip_a_byte(next((tmp_path / "step_000003").glob("*.distcp")))
    (tmp_path / "step_000002" / "manifest.json").write_text("{")
    warnings = []
    assert checkpoint.latest_intact(tmp_path, warn=warnings.append) == tmp_path / "step_000001"
    assert "step_000003 is damaged" in warnings[0] and "does not match its SHA-256" in warnings[0]
    assert "step_000002 is damaged (manifest.json is missing or unreadable" in warnings[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000001",
        "step_000002.damaged",
        "step_000003.damaged",
    ]
    _flip_a_byte(next((tmp_path / "step_000001").glob("*.distcp")))
    with pytest.raises(ValueError, match="no intact checkpoint"):
        checkpoint.latest_intact(tmp_path, warn=warnings.append)


def test_a_step_damaged_again_after_its_retrain_replaces_the_earlier_damaged_copy(tmp_path):
    """The second rename onto STEP.damaged failed ("Directory not empty"): every relaunch stopped there."""
    model, _ = _trained(0)
    for again in (False, True):
        for step in (1, 2):
            checkpoint.save(tmp_path / f"step_{step:06d}", model, files={"again": str(again)})
        _flip_a_byte(next((tmp_path / "step_000002").glob("*.distcp")))
        warnings = []
        assert checkpoint.latest_intact(tmp_path, warn=warnings.append) == tmp_path / "step_000001"
        assert "step_000002 is damaged" in warnings[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002.damaged"]
    assert (tmp_path / "step_000002.damaged" / "again").read_text() == "True"  # the newer one


def test_a_save_killed_while_replacing_the_same_step_keeps_the_old_copy(tmp_path, monkeypatch):
    model, _ = _trained(0)
    path = checkpoint.save(tmp_path / "step_000001", model)
    real_rename = Path.rename

    def killed_before_the_new_copy_lands(self, target):
        if self.name == "step_000001.tmp":  # the checkpoint directory, not a DCP file
            raise KeyboardInterrupt  # stands in for a kill between the two renames
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", killed_before_the_new_copy_lands)
    other, _ = _trained(1)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, other)
    monkeypatch.undo()
    assert checkpoint.latest_intact(tmp_path) == path  # NAME.old put back, NAME.tmp removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    restored, _ = _trained(2)
    checkpoint.load(path, restored)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), restored.parameters()))
