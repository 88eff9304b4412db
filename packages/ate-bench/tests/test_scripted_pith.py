"""`ate-bench run --agent scripted` on Pith itself, on CPU, from a fresh clone of this repository:
op-01, op-03 and op-04 pass with pith.toml's reference procedures (the trainer's own smoke run,
routing trace and profile skill at their tiny default sizes), and op-02, whose evaluation script this
repository does not make, refuses before any attempt with the staging instruction. The clone is of
HEAD: what is not committed is not tested here."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from ate_bench.cli import main

REPO = Path(__file__).resolve().parents[3]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("uv") is None, reason="Pith's procedures set it up with uv"),
]


def test_scripted_agent_passes_pith_operate_tasks_from_a_fresh_clone(tmp_path, monkeypatch, capsys):
    clone = tmp_path / "pith"
    subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(clone)], check=True)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", "--detach", head.stdout.strip()], check=True)
    monkeypatch.setenv("ATE_BENCH_DATA", str(tmp_path / "data"))
    monkeypatch.delenv(
        "TRITON_INTERPRET", raising=False
    )  # set by conftest.py; the trainer runs as users run it
    toml = clone / "packages" / "ate-bench" / "frameworks" / "pith.toml"
    run = ["run", "--framework", str(toml), "--agent", "scripted", "--repeats", "1", "--run-dir"]
    run.append(str(tmp_path / "runs"))

    assert main([*run, "--tasks", "op-02", "--stage"]) == 2
    error = capsys.readouterr().err
    assert (
        f"op-02-train-eval needs eval_script at {tmp_path}/data/eval_hf_ppl.py, which does not exist" in error
    )
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data" / "fineweb-edu-10M").exists()

    assert main([*run, "--tasks", "op-01,op-03,op-04", "--stage"]) == 0
    out = capsys.readouterr().out
    results = [
        json.loads(p.read_text()) for p in sorted((tmp_path / "runs").glob("pith/scripted/*/*/result.json"))
    ]
    assert [r["task"][:5] for r in results] == ["op-01", "op-03", "op-04"], out
    assert [r["grade"]["verdict"] for r in results] == ["PASS"] * 3, [r["grade"] for r in results]
    assert results[0]["grade"]["detail"].startswith("smoke.log: step 5 loss ")
    for r in results:  # the environment is hard links into uv's cache; checkpoints and data are pruned
        assert r["disk"]["owned_bytes"] < 300 * 2**20 and r["disk"]["kept_bytes"] < 30 * 2**20, r["disk"]
    assert "3 attempts" in out and "PASS 3" in out
