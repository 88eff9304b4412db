import json
import subprocess
import sys

import pith_models
import pytest
import torch
from pith_train.cli import main
from pith_train.train import build_model
from safetensors.torch import load_file


def test_convert_hf_to_pith_to_hf_gives_identical_tensors(micro_hf, tmp_path, capsys):
    main(["convert", str(micro_hf), str(tmp_path / "pith")])
    main(["convert", str(tmp_path / "pith"), str(tmp_path / "hf"), "--dtype", "float32"])
    before, after = (
        load_file(micro_hf / "model.safetensors"),
        load_file(tmp_path / "hf" / "model.safetensors"),
    )
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3_moe"
    # A converted checkpoint is a model.name training can start from.
    ours = build_model(str(tmp_path / "pith"), torch.device("cpu"), seed=1).state_dict()
    ref = pith_models.from_pretrained(micro_hf).state_dict()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    with pytest.raises(SystemExit):
        main(["convert", str(tmp_path / "pith"), str(tmp_path / "hf")])  # destination exists
    assert "already exists" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path):
    rows = [{"step": s, "loss": 5 - s, "tokens_per_s": 100 + s} for s in range(1, 4)]
    rows[-1]["val_loss"] = 2.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["plot", str(tmp_path)])
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reports_bad_overrides_and_prints_config(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["pretrain", "--run-dir", str(tmp_path), "--train.nope=1"])
    assert e.value.code == 1 and "unknown key train.nope" in capsys.readouterr().err
    main(["pretrain", "--print-config", "--train.steps", "7"])
    assert "steps = 7" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())


def test_default_command_trains_tiny_moe_on_the_builtin_corpus(tmp_path, subprocess_env):
    """`python -m pith_train pretrain` with only the size reduced: prepares the corpus, trains, saves."""
    run = tmp_path / "run"
    small = ["--train.steps=2", "--data.seq_len=32", "--train.global_batch=2", "--train.micro_batch=2"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pith_train",
            "pretrain",
            "--run-dir",
            str(run),
            *small,
            "--data.val_windows=2",
        ],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"run directory  {run}" in proc.stdout and "checkpoints" in proc.stdout
    meta = json.loads((run / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["num_files"] > 100
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "val_loss" in rows[-1]
    assert {"loss", "lr", "tokens_per_s", "mfu", "grad_norm", "aux", "expert_load_max_over_mean"} <= set(
        rows[0]
    )
    assert (run / "checkpoints" / "step_000002" / ".metadata").is_file()
    assert 'name = "tiny-moe"' in (run / "config.toml").read_text()
