"""Pre-staged inputs: what each task needs, whether it is there, and `ate-bench stage`.

A task lists the inputs it needs (`requires_staged`); the framework TOML says where each lives
([staged_data]) and, where the input can be made on this machine, how ([stage]: a shell command
run in the framework checkout, `{path}` the input's path). `ate-bench run` checks every task before
its first attempt and refuses with one message naming each missing path and how to stage it.
"""

import shlex
import subprocess
from pathlib import Path


def missing_inputs(framework, tasks) -> list[dict]:
    """One entry per (task, input) that is not there: task, name, path (None: no TOML entry), recipe."""
    missing = []
    for task in tasks:
        for name in task.requires_staged:
            path = framework.staged_data.get(name)
            if path is None or not Path(path).exists():
                missing.append(
                    {"task": task.id, "name": name, "path": path, "recipe": framework.stage.get(name)}
                )
    return missing


def how_to_stage(entry: dict, framework) -> str:
    where = f"{entry['task']} needs {entry['name']}"
    if entry["path"] is None:
        return f"{where}, and the {framework.name} TOML has no [staged_data] entry for it: add one"
    if entry["recipe"]:
        short = "-".join(entry["task"].split("-")[:2])
        return (
            f"{where} at {entry['path']}, which does not exist: make it with "
            f"`ate-bench stage {short} --framework {framework.toml}` (or `ate-bench run --stage ...`)"
        )
    return (
        f"{where} at {entry['path']}, which does not exist and cannot be made here (no [stage] recipe "
        f"in the {framework.name} TOML): stage it by hand as the ate-bench README's 'Staged data' says, "
        "or set ATE_BENCH_DATA to the directory holding it"
    )


def staging_problems(framework, tasks) -> str | None:
    """None when every task's inputs are there, else the message naming each missing one."""
    missing = missing_inputs(framework, tasks)
    if not missing:
        return None
    lines = "\n  ".join(how_to_stage(entry, framework) for entry in missing)
    return f"expected the pre-staged inputs of the chosen tasks, got {len(missing)} missing:\n  {lines}"


def stage(framework, tasks, log=print) -> list[str]:
    """Make every missing input of `tasks` that has a recipe; raises ValueError for the others,
    before running any recipe. Returns the paths made."""
    missing = missing_inputs(framework, tasks)
    unmakeable = [e for e in missing if not (e["path"] and e["recipe"])]
    if unmakeable:
        lines = "\n  ".join(how_to_stage(entry, framework) for entry in unmakeable)
        raise ValueError(f"expected inputs this machine can make, got:\n  {lines}")
    made = []
    for entry in {e["path"]: e for e in missing}.values():  # an input two tasks need is made once
        path = Path(entry["path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        command = entry["recipe"].format(path=shlex.quote(str(path)), framework_dir=framework.toml.parent)
        log(f"staging {entry['name']} at {path}: {command}")
        done = subprocess.run(command, shell=True, cwd=framework.path)
        if done.returncode != 0 or not path.exists():
            raise ValueError(
                f"expected `{command}` to make {path}, got exit status {done.returncode} and "
                f"{'a' if path.exists() else 'no'} {path}"
            )
        made.append(str(path))
    return made
