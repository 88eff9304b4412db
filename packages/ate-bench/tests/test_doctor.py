"""`ate-bench doctor`: agent CLIs, GPU sampling through a fake NVML, the package cache, a framework's
checkout and staged inputs."""

import os
import stat
import subprocess
import sys

from ate_bench.cli import main
from ate_bench.doctor import check_gpu, run_checks


def test_doctor_reports_each_check_and_fails_on_what_would_stop_a_run(
    tmp_path, monkeypatch, capsys, FakeNvml
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    claude = bin_dir / "claude"
    claude.write_text(f"#!{sys.executable}\nprint('2.1.0 (Claude Code)')\n")
    claude.chmod(claude.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    checks = {what: (level, detail) for level, what, detail in run_checks(nvml=FakeNvml([30], [[]]))}
    assert checks["agent CLI claude"] == ("ok", "2.1.0 (Claude Code)")
    assert checks["GPU sampling"] == ("ok", "1 GPU(s) through NVML, utilisation now [30]%")
    assert checks["git"][0] == "ok"
    assert check_gpu(FakeNvml([], [], fail_init=True))[0] == "warn"

    repo = tmp_path / "fw"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "a"],
        check=True,
    )
    toml = tmp_path / "fw.toml"
    toml.write_text(f'name = "fw"\npath = "{repo}"\ncommit = "HEAD"\nlaunch_notes = "n"\n'
                    f'[staged_data]\ntrain_data = "{tmp_path}/none"\n')  # fmt: skip
    assert main(["doctor", "--framework", str(toml), "--tasks", "op-01", "--run-dir", str(tmp_path)]) == 0
    assert main(["doctor", "--framework", str(toml), "--tasks", "op-03", "--agent", "codex"]) == 1
    out = capsys.readouterr().out
    assert (
        "FAIL  staged train_data " in out
        and f"op-03-routing-trace needs train_data at {tmp_path}/none" in out
    )
    assert "ok    fw checkout" in out
