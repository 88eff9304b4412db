"""`ate-bench doctor`: is this machine ready for a run? Checks the agent CLIs, git, GPU sampling
(NVML), the framework checkout and its staged inputs, and whether attempts' environments can
share the package cache (uv's cache and the run directory on one filesystem, so environments are
hard links into the cache rather than copies). Each check is `ok`, `warn` (the run works, a
figure or a saving is lost) or `FAIL` (the run would refuse or fail).
"""

import os
import shutil
import subprocess
from pathlib import Path

from ate_bench.gpu import load_nvml
from ate_bench.runner import resolve_source
from ate_bench.staging import how_to_stage, missing_inputs

AGENT_CLIS = {"claude": "claude", "codex": "codex"}


def command_line(argv: list[str]) -> str | None:
    """The first output line of argv, None when it cannot run or fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (done.stdout or done.stderr).strip().splitlines()
    return (lines[0] if lines else "") if done.returncode == 0 else None


def check_agents(agent: str | None) -> list[tuple[str, str, str]]:
    found = []
    for name, executable in AGENT_CLIS.items():
        version = command_line([executable, "--version"]) if shutil.which(executable) else None
        if version is not None:
            found.append(("ok", f"agent CLI {executable}", version))
        else:
            level = "FAIL" if agent == name else "warn"
            found.append((level, f"agent CLI {executable}", "not on PATH or `--version` failed"))
    return found


def check_gpu(nvml=None) -> tuple[str, str, str]:
    nvml = load_nvml() if nvml is None else nvml
    if nvml is None:
        return ("warn", "GPU sampling", "no NVML library: active_gpu_time_s will be null (right on CPU)")
    try:
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
        busy = [
            nvml.nvmlDeviceGetUtilizationRates(nvml.nvmlDeviceGetHandleByIndex(i)).gpu for i in range(count)
        ]
        for i in range(count):
            nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(i))
        nvml.nvmlShutdown()
    except Exception as error:  # NVML raises its own error types; any of them means no sampling
        return ("warn", "GPU sampling", f"NVML failed ({error}): active_gpu_time_s will be null")
    return ("ok", "GPU sampling", f"{count} GPU(s) through NVML, utilisation now {busy}%")


def existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def check_shared_cache(run_dir: Path) -> tuple[str, str, str]:
    if shutil.which("uv") is None:
        return ("warn", "package cache", "uv not on PATH: a framework that needs it cannot be set up")
    cache = command_line(["uv", "cache", "dir"])
    if not cache:
        return ("warn", "package cache", "`uv cache dir` failed")
    same = os.stat(existing_parent(Path(cache))).st_dev == os.stat(existing_parent(run_dir)).st_dev
    if same:
        return (
            "ok",
            "package cache",
            f"uv cache {cache} on the run directory's filesystem: environments share it",
        )
    return (
        "warn", "package cache",
        f"uv cache {cache} is on another filesystem than {run_dir}: each attempt's environment is a full "
        "copy (GBs); set UV_CACHE_DIR to a directory on the run's filesystem",
    )  # fmt: skip


def check_framework(framework, tasks) -> list[tuple[str, str, str]]:
    found = []
    try:
        found.append(
            ("ok", f"{framework.name} checkout", f"{framework.path} at {resolve_source(framework)[:12]}")
        )
    except ValueError as error:
        found.append(("FAIL", f"{framework.name} checkout", str(error)))
    missing = missing_inputs(framework, tasks)
    for entry in missing:
        found.append(("FAIL", f"staged {entry['name']}", how_to_stage(entry, framework)))
    needed = sorted({name for task in tasks for name in task.requires_staged} - {e["name"] for e in missing})
    found += [("ok", f"staged {name}", framework.staged_data[name]) for name in needed]
    return found


def run_checks(framework=None, tasks=(), run_dir: Path = Path("ate-runs"), agent=None, nvml=None):
    checks = check_agents(agent)
    checks.append(
        ("ok", "git", command_line(["git", "--version"]))
        if shutil.which("git")
        else ("FAIL", "git", "not on PATH")
    )
    checks += [check_gpu(nvml), check_shared_cache(Path(run_dir))]
    if framework is not None:
        checks += check_framework(framework, tasks)
    return checks


def format_checks(checks) -> str:
    return "".join(f"{level:<5} {what:<24} {detail}\n" for level, what, detail in checks)
