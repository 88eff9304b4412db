"""The task suite: 20 tasks in three TOML files under tasks/ (one per category).

A category file holds `category`, `read_only` (the agent gets the read-only tool set),
`time_limit_s` (the default per-attempt wall-clock limit), a `preamble` put before every prompt
of the category, optionally `requires_staged` (pre-staged data the framework must provide), and
a list of `[[task]]` tables with `id`, `title`, `prompt` and a `grading` table whose `kind`
selects the check in grading.py.
"""

import tomllib
from dataclasses import dataclass
from pathlib import Path

TASK_DIR = Path(__file__).parent / "tasks"
CATEGORY_FILES = ("qa.toml", "operate.toml", "feature.toml")
CATEGORY_KEYS = {"category", "read_only", "time_limit_s", "preamble", "requires_staged", "task"}
TASK_KEYS = {"id", "title", "prompt", "grading", "requires_staged"}
GRADING_KINDS = {
    "qa": set(),
    "smoke_log": {"file", "step"},
    "train_eval": {"export_dir", "eval_file"},
    "routing_trace": {"dir", "tokens"},
    "top_kernels": {"file", "profile_prefix"},
    "feature": {"loss_file", "steps", "rules"},
}


@dataclass(frozen=True)
class Task:
    id: str
    category: str
    title: str
    prompt: str  # the full prompt: category preamble + task text
    question: str  # the task text alone (for the human grading sheet)
    grading: dict
    read_only: bool
    time_limit_s: float
    requires_staged: tuple[str, ...]


def check_keys(where: str, table: dict, allowed: set[str], required: set[str]) -> None:
    unknown = set(table) - allowed
    missing = required - set(table)
    if unknown or missing:
        raise ValueError(
            f"{where}: expected keys {sorted(required)} (optional {sorted(allowed - required)}), "
            f"got unknown {sorted(unknown)} and missing {sorted(missing)}"
        )


def load_category(path: Path) -> list[Task]:
    data = tomllib.loads(Path(path).read_text())
    check_keys(str(path), data, CATEGORY_KEYS, {"category", "read_only", "time_limit_s", "preamble", "task"})
    tasks = []
    for entry in data["task"]:
        where = f"{path} task {entry.get('id', '?')!r}"
        check_keys(where, entry, TASK_KEYS, {"id", "title", "prompt", "grading"})
        grading = entry["grading"]
        kind = grading.get("kind")
        if kind not in GRADING_KINDS:
            raise ValueError(f"{where}: expected grading.kind in {sorted(GRADING_KINDS)}, got {kind!r}")
        fields = GRADING_KINDS[kind]
        check_keys(f"{where} grading", grading, fields | {"kind", "reference"}, fields | {"kind"})
        tasks.append(
            Task(
                id=entry["id"],
                category=data["category"],
                title=entry["title"],
                prompt=data["preamble"].strip() + "\n\n" + entry["prompt"].strip() + "\n",
                question=" ".join(entry["prompt"].split()),
                grading=grading,
                read_only=bool(data["read_only"]),
                time_limit_s=float(data["time_limit_s"]),
                requires_staged=tuple(entry.get("requires_staged", data.get("requires_staged", ()))),
            )
        )
    return tasks


def load_tasks(task_dir: Path = TASK_DIR) -> list[Task]:
    tasks = [t for name in CATEGORY_FILES for t in load_category(Path(task_dir) / name)]
    ids = [t.id for t in tasks]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"expected unique task ids, got duplicates {duplicates}")
    return tasks


def select_tasks(tasks: list[Task], wanted: list[str] | None) -> list[Task]:
    """Tasks by id, id prefix or category name; all of them when `wanted` is empty."""
    if not wanted:
        return tasks
    chosen = []
    for key in wanted:
        matches = [t for t in tasks if t.id == key or t.id.startswith(key) or t.category == key]
        if not matches:
            raise ValueError(f"expected a task id, id prefix or category (qa, operate, feature), got {key!r}")
        chosen += [t for t in matches if t not in chosen]
    return chosen
