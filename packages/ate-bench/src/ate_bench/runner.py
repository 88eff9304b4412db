"""`ate-bench run`: every (task, repeat) attempt of one agent on one framework.

Layout of a run directory:
    RUN/<framework>/<agent>/<task id>/attempt-<n>/
        worktree/            a git worktree of the framework at the pinned commit (the agent's cwd)
        worktree/ate-artifacts/  where operate / feature tasks leave their artifacts
        prompt.md            the exact prompt given
        transcript.jsonl     the agent's stdout
        agent.stderr
        result.json          status, metrics, GPU time, disk use and grade; written last, atomically

Disk: attempts share the package cache of the framework's tools (uv hard-links, or on macOS clones,
an environment's files from its one cache, so a worktree's `uv sync` adds a few MB, not a copy of
torch). Each attempt's disk is measured while it runs; past `max_disk_gb` of its own (files nothing
outside the attempt links to) it is ended (status `disk_limit`). After grading, what git ignores in
the worktree (environments, checkpoints, caches) is deleted unless `keep_outputs`: the kept attempt
is its transcript, its edits and its artifacts. result.json records the bytes before and after.

An attempt with a result.json is finished and never rerun (runs resume); a directory without one
is the remains of an interrupted attempt and is started afresh. The user's checkout is only read:
it must be clean (no modified or untracked files), and the run directory must lie outside it.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ate_bench.agents import ClaudeCode, Codex
from ate_bench.gpu import GpuSampler
from ate_bench.grading import grade_attempt
from ate_bench.staging import staging_problems
from ate_bench.transcript import transcript_metrics

KILL_GRACE_S = 5.0  # SIGTERM first, so a training job can release the GPU cleanly; then SIGKILL
DISK_CHECK_S = 10.0  # between disk measurements of a running attempt (a walk of ~25k files: ~0.2 s)
MAX_DISK_GB = 20.0


def git(*args: str, cwd: Path) -> str:
    done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"git {' '.join(args)} in {cwd} failed: {done.stderr.strip()}")
    return done.stdout.rstrip()  # not strip(): porcelain lines start with a status column


def resolve_source(framework) -> str:
    """The full sha attempts check out; refuses a checkout with local changes."""
    if not framework.path.is_dir():
        raise ValueError(f"expected the {framework.name} checkout at {framework.path}, got no such directory")
    top = Path(git("rev-parse", "--show-toplevel", cwd=framework.path)).resolve()
    if top != framework.path.resolve():
        raise ValueError(
            f"expected {framework.path} to be the root of a git checkout, got one rooted at {top}"
        )
    changes = local_changes(framework.path)
    if changes:
        raise ValueError(
            f"expected a clean {framework.name} checkout at {framework.path}, got local changes "
            f"({changes}); commit or stash them first"
        )
    return git("rev-parse", "--verify", f"{framework.commit}^{{commit}}", cwd=framework.path)


def local_changes(checkout: Path) -> str:
    """The first few modified or untracked paths of a checkout, '' when it is clean."""
    lines = git("status", "--porcelain", "--untracked-files=normal", cwd=checkout).splitlines()
    return ", ".join(line[3:] for line in lines[:5]) + (", ..." if len(lines) > 5 else "")


def remove_worktree(source: Path, worktree: Path) -> None:
    if worktree.exists():
        subprocess.run(
            ["git", "-C", str(source), "worktree", "remove", "--force", str(worktree)], capture_output=True
        )
        shutil.rmtree(worktree, ignore_errors=True)
    subprocess.run(["git", "-C", str(source), "worktree", "prune"], capture_output=True)


def create_worktree(source: Path, sha: str, worktree: Path) -> None:
    remove_worktree(source, worktree)
    worktree.parent.mkdir(parents=True, exist_ok=True)
    git("worktree", "add", "--detach", str(worktree), sha, cwd=source)


def processes() -> list[tuple[int, int, int, int]]:
    """(pid, ppid, process group, session) of every visible process (Linux /proc)."""
    table = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, session
        if fields[0] == "Z":  # already dead, waiting to be reaped: nothing left to kill
            continue
        table.append((int(entry.name), int(fields[1]), int(fields[2]), int(fields[3])))
    return table


def attempt_processes(leader: int) -> set[int]:
    """The agent's session and process group plus all its descendants (which may have left both)."""
    table = processes()
    found = {pid for pid, _, group, session in table if leader in (group, session)}
    children = {}
    for pid, ppid, _, _ in table:
        children.setdefault(ppid, []).append(pid)
    stack, seen = [leader], {leader}
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return (found | seen) - {os.getpid()}


def signal_all(pids: set[int], leader: int, sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, sig)


def kill_attempt(proc: subprocess.Popen) -> None:
    """End the agent and everything it started."""
    targets = attempt_processes(proc.pid)
    signal_all(targets, proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline and (proc.poll() is None or attempt_processes(proc.pid) - {proc.pid}):
        time.sleep(0.05)
    signal_all(targets | attempt_processes(proc.pid), proc.pid, signal.SIGKILL)
    proc.wait()


def disk_use(root: Path) -> dict:
    """Bytes on disk under `root` (allocated blocks, a hard-linked file once): `bytes`, and
    `owned_bytes`, those of files no path outside `root` links to (what deleting it frees)."""
    inodes = {}  # (device, inode) -> [links seen under root, links in all, bytes]
    stack = [Path(root)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            is_dir = entry.is_dir(follow_symlinks=False)
            if is_dir:
                stack.append(Path(entry.path))
            record = inodes.setdefault((info.st_dev, info.st_ino), [0, 1 if is_dir else info.st_nlink, 0])
            record[0], record[2] = record[0] + 1, info.st_blocks * 512
    return {
        "bytes": sum(size for _, _, size in inodes.values()),
        "owned_bytes": sum(size for seen, links, size in inodes.values() if seen >= links),
    }


def prune_outputs(worktree: Path) -> None:
    """Delete what git ignores in the worktree (environments, checkpoints, caches), not the artifacts."""
    listed = subprocess.run(
        ["git", "-C", str(worktree), "ls-files", "-z", "--others", "--ignored", "--exclude-standard",
         "--directory"], capture_output=True,
    )  # fmt: skip
    for name in listed.stdout.decode(errors="replace").split("\0"):
        if not name or name.startswith("ate-artifacts/"):
            continue
        path = worktree / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_attempt(
    task, framework, sha, agent, attempt_dir: Path, repeat: int, timeout_s, judge=None, gpu_scope="attempt",
    nvml=None, max_disk_gb=MAX_DISK_GB, keep_outputs=False,
):  # fmt: skip
    """Run one attempt to completion (or timeout), grade it, write result.json; returns the record."""
    worktree = attempt_dir / "worktree"
    create_worktree(framework.path, sha, worktree)
    (worktree / "ate-artifacts").mkdir(exist_ok=True)
    prompt = task.prompt + "\n" + framework.notes_for_agent()
    prompt_file = attempt_dir / "prompt.md"
    prompt_file.write_text(prompt)
    command = agent.command(prompt, task.read_only, worktree, prompt_file)
    env = os.environ | framework.env | {"ATE_ARTIFACTS": str(worktree / "ate-artifacts"), "ATE_TASK": task.id}
    transcript = attempt_dir / "transcript.jsonl"
    sampler = GpuSampler(nvml=nvml, scope=gpu_scope).start()
    started = time.monotonic()
    with open(transcript, "wb") as out, open(attempt_dir / "agent.stderr", "wb") as err:
        proc = subprocess.Popen(
            command,
            shell=isinstance(command, str),
            cwd=worktree,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,  # its own session and process group: one signal reaches all of it
        )
        sampler.set_session(proc.pid)
        status, deadline = "finished", started + timeout_s
        try:
            while status == "finished":
                try:
                    proc.wait(timeout=max(0.0, min(DISK_CHECK_S, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        status = "timeout"
                    elif disk_use(attempt_dir)["owned_bytes"] > max_disk_gb * 2**30:
                        status = "disk_limit"
        finally:
            wall_s = time.monotonic() - started
            kill_attempt(proc)  # the agent on timeout or Ctrl-C; otherwise whatever it left running
    exit_code = proc.returncode
    sampler.stop()
    metrics = transcript_metrics(transcript)
    final_text = metrics.pop("final_text")
    metrics["active_gpu_time_s"] = sampler.active_gpu_time_s
    if status == "finished" and exit_code != 0:
        status = "agent_error"
    try:
        grade = grade_attempt(task, worktree, final_text, attempt_dir, sha, judge)
    except (OSError, ValueError, subprocess.CalledProcessError) as error:
        grade = {"verdict": "ERROR", "error": repr(error)}
    write_json(attempt_dir / "gpu.json", sampler.summary())
    disk = disk_use(attempt_dir)
    if not keep_outputs:
        prune_outputs(worktree)
    disk["kept_bytes"] = disk_use(attempt_dir)["owned_bytes"]
    record = {
        "framework": framework.name,
        "agent": agent.name,
        "task": task.id,
        "category": task.category,
        "repeat": repeat,
        "commit": sha,
        "status": status,
        "exit_code": exit_code,
        "wall_s": wall_s,
        "time_limit_s": timeout_s,
        "metrics": metrics,
        "disk": disk,
        "grade": grade,
    }
    write_json(attempt_dir / "result.json", record)
    return record


def run_suite(
    framework, tasks, agent, run_dir: Path, repeats=3, timeout_s=None, judge=None, gpu_scope="attempt",
    nvml=None, log=print, max_disk_gb=MAX_DISK_GB, keep_outputs=False,
) -> list[dict]:  # fmt: skip
    """All attempts of `tasks` x `repeats`; finished ones are loaded, not rerun."""
    if repeats < 1:
        raise ValueError(f"expected repeats >= 1, got {repeats}")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"expected a positive timeout in seconds, got {timeout_s}")
    if max_disk_gb <= 0:
        raise ValueError(f"expected a positive per-attempt disk limit in GB, got {max_disk_gb}")
    problems = staging_problems(framework, tasks)
    if problems:
        raise ValueError(problems)
    run_dir = Path(run_dir).resolve()
    if run_dir.is_relative_to(framework.path.resolve()):
        raise ValueError(f"expected the run directory outside the checkout {framework.path}, got {run_dir}")
    if isinstance(agent, ClaudeCode | Codex) and shutil.which(agent.executable) is None:
        raise ValueError(f"expected the {agent.name} CLI {agent.executable!r} on PATH, got none")
    sha = resolve_source(framework)
    head = git("rev-parse", "HEAD", cwd=framework.path)
    records = []
    for task in tasks:
        for repeat in range(1, repeats + 1):
            attempt_dir = run_dir / framework.name / agent.name / task.id / f"attempt-{repeat}"
            result_file = attempt_dir / "result.json"
            if result_file.is_file():
                records.append(json.loads(result_file.read_text()))
                log(f"{task.id} attempt {repeat}: done before, kept")
                continue
            if attempt_dir.exists():
                remove_worktree(framework.path, attempt_dir / "worktree")
                shutil.rmtree(attempt_dir)
            attempt_dir.mkdir(parents=True)
            limit = timeout_s or task.time_limit_s
            log(f"{task.id} attempt {repeat}: running (limit {limit:.0f}s)")
            record = run_attempt(
                task, framework, sha, agent, attempt_dir, repeat, limit, judge, gpu_scope, nvml, max_disk_gb,
                keep_outputs,
            )  # fmt: skip
            disk = record["disk"]
            log(
                f"{task.id} attempt {repeat}: {record['status']}, {record['grade']['verdict']}"
                f" ({record['grade'].get('detail') or record['grade'].get('reason', '')});"
                f" disk {disk['owned_bytes'] / 2**20:.0f} MB of its own,"
                f" {disk['kept_bytes'] / 2**20:.0f} MB kept"
            )
            records.append(record)
            # A worktree cannot stop an agent from walking out of it: check the user's checkout.
            changes = local_changes(framework.path)
            if changes or git("rev-parse", "HEAD", cwd=framework.path) != head:
                raise ValueError(
                    f"expected attempts to leave the checkout {framework.path} alone, got it changed "
                    f"during {attempt_dir} ({changes or 'HEAD moved'}); stopping the run"
                )
    return records
