"""A full `ate-bench run` driven by a scripted fake agent (fake_agent.py, made executable in a
temporary directory): worktrees, timeout kill, metrics, grading, resume, report and compare."""

import csv
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from ate_bench import runner
from ate_bench.agents import ClaudeCode, Codex, Generic, make_agent
from ate_bench.cli import main
from ate_bench.frameworks import load_framework
from ate_bench.report import compare, write_report
from ate_bench.runner import KILL_GRACE_S, disk_use, prune_outputs, run_suite
from ate_bench.staging import stage
from ate_bench.tasks import load_tasks, select_tasks

TRAIN_PY = """\
import torch.distributed as dist


def setup(backend):
    dist.init_process_group(backend)
    return dist.get_rank()
"""


def make_framework_repo(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "train.py").write_text(TRAIN_PY)
    (root / "model.py").write_text("class Model:\n    pass\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    return root


def write_framework_toml(path: Path, name: str, checkout: Path, scale: int = 1, extra: str = "") -> Path:
    path.write_text(
        f'name = "{name}"\npath = "{checkout}"\ncommit = "HEAD"\n'
        'launch_notes = "Run python train.py."\n'
        f'[staged_data]\ntrain_data = "{checkout.parent}"\n'
        f'[env]\nFAKE_SCALE = "{scale}"\n' + extra
    )
    return path


@pytest.fixture
def setup(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    agent = bin_dir / "fake-agent"
    agent.write_text(f"#!{sys.executable}\n" + (Path(__file__).parent / "fake_agent.py").read_text())
    agent.chmod(agent.stat().st_mode | stat.S_IEXEC)
    shutil.copy(agent, bin_dir / "claude")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_AGENT_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("FAKE_AGENT_PIDS", str(tmp_path / "pids.txt"))
    repo = make_framework_repo(tmp_path / "frameworks" / "alpha")
    toml = write_framework_toml(tmp_path / "alpha.toml", "alpha", repo)
    return tmp_path, load_framework(toml), Generic(f"{agent} {{prompt_file}}", name="fake")


def calls(tmp_path) -> list[list[str]]:
    log = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def read_csv(path: Path) -> list[dict]:
    return list(csv.DictReader(path.read_text().splitlines()))


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_full_run_grades_times_out_resumes_and_reports(setup, FakeNvml):
    tmp_path, framework, agent = setup
    tasks = select_tasks(load_tasks(), ["qa-01", "op-01", "op-04", "nf-01"])
    run_dir = tmp_path / "runs"
    judge = (
        "grep -q 'def diff_attention' {prompt_file} && printf 'RULE 1: PASS\\nRULE 2: PASS\\nRULE 3: PASS\\n'"
    )
    records = run_suite(
        framework, tasks, agent, run_dir, repeats=2, timeout_s=2.5, judge=judge,
        gpu_scope="all", nvml=FakeNvml([40], [[]]), log=lambda _: None,
    )  # fmt: skip
    by_task = {}
    for r in records:
        by_task.setdefault(r["task"], []).append(r)
    assert len(records) == 8 and len(calls(tmp_path)) == 8

    qa = by_task["qa-01-process-groups"][0]
    assert qa["status"] == "finished" and qa["grade"]["verdict"] == "NEEDS_HUMAN"
    assert qa["grade"]["citations"][0]["matched"] == ["init_process_group", "setup"]
    assert qa["metrics"]["agent_turns"] == 3 and qa["metrics"]["output_tokens"] == 250
    assert qa["metrics"]["tool_calls"]["exploring"] == 2
    assert by_task["op-01-getting-started"][0]["grade"]["verdict"] == "PASS"
    feature = by_task["nf-01-diff-attention"][0]
    assert feature["grade"]["verdict"] == "PASS" and feature["grade"]["judge"]["rules"] == {
        1: True,
        2: True,
        3: True,
    }

    timed_out = by_task["op-04-heavy-kernels"][1]
    assert timed_out["status"] == "timeout" and timed_out["grade"]["verdict"] == "FAIL"
    assert timed_out["metrics"]["complete"] is False and timed_out["metrics"]["tool_calls"]["running"] == 1
    assert 2.5 <= timed_out["wall_s"] < 10
    # The fake GPU is always busy; sampling runs on while the attempt's processes are being killed.
    assert 1.0 < timed_out["metrics"]["active_gpu_time_s"] < timed_out["wall_s"] + KILL_GRACE_S
    agent_pid, helper_pid = map(int, (tmp_path / "pids.txt").read_text().split())
    assert not alive(agent_pid) and not alive(helper_pid)  # the detached helper was killed too

    # Each attempt ran in its own worktree at the pinned commit; the user's checkout is untouched.
    attempt = run_dir / "alpha" / "fake" / "nf-01-diff-attention" / "attempt-1"
    assert "diff_attention" in (attempt / "worktree" / "model.py").read_text()
    assert "diff_attention" not in (framework.path / "model.py").read_text()
    status = subprocess.run(["git", "-C", str(framework.path), "status", "--porcelain"], capture_output=True)
    assert status.stdout == b""
    notes = "Framework notes (alpha):\nRun python train.py.\n"
    notes += f"Pre-staged data (name: path):\n  train_data: {framework.path.parent}\n"
    assert (attempt / "prompt.md").read_text().endswith(notes)

    # Resume: finished attempts are kept; an interrupted one (no result.json) is rerun.
    (run_dir / "alpha" / "fake" / "op-01-getting-started" / "attempt-2" / "result.json").unlink()
    again = run_suite(framework, tasks, agent, run_dir, repeats=2, timeout_s=2.5, log=lambda _: None)
    assert len(again) == 8 and len(calls(tmp_path)) == 9 and calls(tmp_path)[-1][0].endswith("prompt.md")

    # A second framework where the agent spends twice the tokens, then report and compare.
    repo = make_framework_repo(tmp_path / "frameworks" / "beta")
    beta = load_framework(write_framework_toml(tmp_path / "beta.toml", "beta", repo, scale=2))
    run_suite(beta, tasks[:1], agent, run_dir, repeats=2, log=lambda _: None)
    questions = {t.id: (t.question, t.grading.get("reference", "")) for t in load_tasks()}
    summary = write_report(run_dir, tmp_path / "out", questions)
    rows = {(r["framework"], r["task"]): r for r in read_csv(tmp_path / "out" / "report.csv")}
    assert float(rows["alpha", "qa-01-process-groups"]["output_tokens"]) == 250
    assert rows["alpha", "op-04-heavy-kernels"]["timeouts"] == "2"
    assert (tmp_path / "out" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert (
        "| alpha | fake | op-01-getting-started | 2 | 0 | 2 |" in (tmp_path / "out" / "report.md").read_text()
    )
    assert summary["sheet_rows"] == 4
    sheet = read_csv(tmp_path / "out" / "grading-sheet.csv")
    assert sheet[0]["citations_valid"] == "1" and "init_process_group" in sheet[0]["answer"]
    assert sheet[0]["question"].startswith("Starting from the script a user launches for pre-training")
    text, relative = compare(run_dir, baseline="alpha")
    assert [r["task"] for r in relative] == ["qa-01-process-groups", "(all shared tasks)"]
    assert relative[0]["framework"] == "beta" and relative[1]["output_tokens"] == pytest.approx(1.0)
    assert relative[0]["output_tokens"] == pytest.approx(1.0) and relative[0][
        "session_duration_s"
    ] == pytest.approx(1.0)
    assert "+100%" in text


def test_claude_adapter_gets_read_only_tools_for_qa(setup):
    tmp_path, framework, _ = setup
    tasks = select_tasks(load_tasks(), ["qa-01", "op-01"])
    records = run_suite(
        framework, tasks, make_agent("claude"), tmp_path / "runs", repeats=1, log=lambda _: None
    )
    assert [r["agent"] for r in records] == ["claude-code", "claude-code"]
    qa_argv, op_argv = calls(tmp_path)
    assert qa_argv[2:5] == ["--output-format", "stream-json", "--verbose"]
    assert qa_argv[qa_argv.index("--allowedTools") + 1] == "Read,Grep,Glob,LS"
    assert "Edit" in qa_argv[qa_argv.index("--disallowedTools") + 1]
    assert "--allowedTools" not in op_argv and op_argv[-2:] == ["--permission-mode", "bypassPermissions"]
    assert records[0]["grade"]["verdict"] == "NEEDS_HUMAN" and records[1]["grade"]["verdict"] == "PASS"


def test_codex_and_generic_commands(tmp_path):
    argv = Codex().command("PROMPT", True, tmp_path, tmp_path / "p.md")
    assert argv[:3] == ["codex", "exec", "--json"] and argv[-3:] == ["--sandbox", "read-only", "PROMPT"]
    assert "--dangerously-bypass-approvals-and-sandbox" in Codex().command(
        "P", False, tmp_path, tmp_path / "p.md"
    )
    generic = Generic("my-agent --ro {read_only} --in {prompt_file} --cwd {worktree}")
    assert (
        generic.command("P", True, Path("/w"), Path("/a b/p.md"))
        == "my-agent --ro 1 --in '/a b/p.md' --cwd /w"
    )
    assert ClaudeCode(model="opus").command("P", True, tmp_path, tmp_path)[6:8] == ["--model", "opus"]
    with pytest.raises(ValueError, match="prompt_file"):
        Generic("my-agent")
    with pytest.raises(ValueError, match="claude, codex or scripted"):
        make_agent("gemini")


def test_dirty_checkout_is_refused(setup):
    tmp_path, framework, agent = setup
    (framework.path / "scratch.py").write_text("x = 1\n")
    (framework.path / "train.py").write_text("edited\n")
    with pytest.raises(ValueError, match=r"clean alpha checkout.*\(train\.py, scratch\.py\)"):
        run_suite(framework, load_tasks()[:1], agent, tmp_path / "runs", repeats=1, log=lambda _: None)
    assert calls(tmp_path) == []


def test_agent_that_changes_the_users_checkout_stops_the_run(setup):
    tmp_path, framework, agent = setup
    tasks = select_tasks(load_tasks(), ["nf-03", "qa-01"])
    with pytest.raises(ValueError, match=r"leave the checkout .* alone.*stray\.py"):
        run_suite(framework, tasks, agent, tmp_path / "runs", repeats=1, log=lambda _: None)
    assert len(calls(tmp_path)) == 1  # stopped before the next attempt


def test_run_dir_inside_checkout_and_missing_staged_data_are_refused(setup):
    tmp_path, framework, agent = setup
    with pytest.raises(ValueError, match="outside the checkout"):
        run_suite(framework, load_tasks()[:1], agent, framework.path / "runs", log=lambda _: None)
    bare = load_framework(write_framework_toml(tmp_path / "bare.toml", "bare", framework.path))
    bare = type(bare)(bare.name, bare.path, bare.commit, bare.launch_notes)
    with pytest.raises(ValueError, match="op-02-train-eval.*eval_script"):
        run_suite(bare, select_tasks(load_tasks(), ["op-02"]), agent, tmp_path / "runs", log=lambda _: None)


def test_cli_run_then_report(setup, capsys):
    tmp_path, framework, _ = setup
    agent = tmp_path / "bin" / "fake-agent"
    args = ["run", "--framework", str(tmp_path / "alpha.toml"), "--tasks", "op-01", "--repeats", "1",
            "--agent-command", f"{agent} {{prompt_file}}", "--run-dir", str(tmp_path / "runs")]  # fmt: skip
    assert main(args) == 0
    assert "1 attempts" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "runs")]) == 0
    assert "| alpha | generic | op-01-getting-started |" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "runs")]) == 2  # one framework: nothing to compare
    assert main(["run", "--framework", str(tmp_path / "nope.toml")]) == 2


SCRIPTED = """
[scripted]
op-01 = "printf 'step 4 loss 7.6\\nstep 5 loss 7.5\\n' | tee $ATE_ARTIFACTS/smoke.log"
op-04 = "printf 'kernel,ms\\n' > $ATE_ARTIFACTS/top-kernels.csv"
op-03 = "head -c 3000000 /dev/zero > big.bin; sleep 30"
"""


def test_scripted_agent_runs_the_toml_procedures_and_the_graders_judge_them(setup, monkeypatch):
    tmp_path, _, _ = setup
    monkeypatch.setattr(runner, "DISK_CHECK_S", 0.2)
    toml = write_framework_toml(
        tmp_path / "s.toml", "alpha", tmp_path / "frameworks" / "alpha", extra=SCRIPTED
    )
    framework = load_framework(toml)
    tasks = select_tasks(load_tasks(), ["op-01", "op-04", "op-03", "qa-01"])
    records = run_suite(
        framework, tasks, make_agent("scripted", framework=framework), tmp_path / "runs", repeats=1,
        max_disk_gb=0.002, log=lambda _: None,
    )  # fmt: skip
    smoke, kernels, trace, qa = records
    assert smoke["agent"] == "scripted" and smoke["grade"] == {
        "verdict": "PASS",
        "detail": "smoke.log: step 5 loss 7.5",
    }
    assert smoke["metrics"]["agent_turns"] == 2 and smoke["metrics"]["output_tokens"] == 0
    assert smoke["metrics"]["tool_calls"]["running"] == 1
    assert kernels["status"] == "finished" and kernels["grade"]["verdict"] == "FAIL"
    assert kernels["grade"]["detail"].startswith("top-kernels.csv: expected the header kernel_name,")
    # 3 MB of its own against a 2 MB bound: ended at the next measurement, not after 30 s
    assert trace["status"] == "disk_limit" and trace["wall_s"] < 10 and trace["disk"]["owned_bytes"] > 2**21
    assert trace["disk"]["kept_bytes"] == trace["disk"]["owned_bytes"]  # untracked, not ignored: kept
    assert qa["status"] == "agent_error" and qa["grade"]["verdict"] == "FAIL"  # no procedure for qa-01
    with pytest.raises(ValueError, match=r"\[scripted\] table"):
        make_agent("scripted", framework=load_framework(tmp_path / "alpha.toml"))


def test_missing_staged_input_refuses_before_any_attempt_then_stage_makes_it(setup, capsys):
    tmp_path, _, agent = setup
    data = tmp_path / "staged" / "tokens"
    recipe = '[stage]\ntrain_data = "mkdir -p {path} && touch {path}/meta.json"\n'
    toml = write_framework_toml(
        tmp_path / "st.toml", "alpha", tmp_path / "frameworks" / "alpha", extra=recipe
    )
    toml.write_text(toml.read_text().replace(f'"{data.parent.parent / "frameworks"}"', f'"{data}"'))
    framework = load_framework(toml)
    tasks = select_tasks(load_tasks(), ["op-01", "op-03"])
    with pytest.raises(ValueError) as refused:
        run_suite(framework, tasks, agent, tmp_path / "runs", repeats=1, log=lambda _: None)
    assert f"op-03-routing-trace needs train_data at {data}, which does not exist" in str(refused.value)
    assert f"`ate-bench stage op-03 --framework {toml}`" in str(refused.value)
    assert calls(tmp_path) == [] and not (tmp_path / "runs").exists()  # nothing started
    assert main(["stage", "op-03", "--framework", str(toml)]) == 0 and (data / "meta.json").is_file()
    assert f"staged {data}" in capsys.readouterr().out
    records = run_suite(
        framework, tasks, agent, tmp_path / "runs", repeats=1, timeout_s=1, log=lambda _: None
    )
    assert [r["grade"]["verdict"] for r in records] == ["PASS", "FAIL"]  # the fake agent cannot trace
    # An input without a recipe cannot be staged here: the message says so, nothing runs.
    with pytest.raises(ValueError, match=r"op-02-train-eval needs eval_script, and the alpha TOML has no"):
        stage(framework, select_tasks(load_tasks(), ["op-02"]))


def test_disk_use_counts_hard_links_into_a_shared_cache_as_not_owned(tmp_path):
    cache, attempt = tmp_path / "cache", tmp_path / "attempt"
    (attempt / "env").mkdir(parents=True)
    cache.mkdir()
    (cache / "torch.so").write_bytes(b"x" * 100_000)
    os.link(cache / "torch.so", attempt / "env" / "torch.so")  # what uv does from its cache
    (attempt / "own.bin").write_bytes(b"y" * 50_000)
    os.link(attempt / "own.bin", attempt / "own-again.bin")  # both links inside: owned, counted once
    use = disk_use(attempt)
    assert use["bytes"] - use["owned_bytes"] >= 100_000 and 50_000 <= use["owned_bytes"] < 100_000


def test_prune_outputs_deletes_what_git_ignores_but_not_artifacts_or_edits(tmp_path):
    repo = make_framework_repo(tmp_path / "repo")
    (repo / ".gitignore").write_text(".venv/\n*.json\n")
    (repo / ".venv" / "lib").mkdir(parents=True)
    (repo / ".venv" / "lib" / "torch.so").write_bytes(b"x")
    (repo / "ate-artifacts").mkdir()
    (repo / "ate-artifacts" / "profile.json").write_text("{}")  # ignored by *.json, kept: an artifact
    (repo / "ckpt.json").write_text("{}")
    (repo / "model.py").write_text("edited\n")
    prune_outputs(repo)
    assert not (repo / ".venv").exists() and not (repo / "ckpt.json").exists()
    assert (repo / "ate-artifacts" / "profile.json").is_file() and (
        repo / "model.py"
    ).read_text() == "edited\n"
