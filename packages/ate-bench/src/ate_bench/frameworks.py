"""A framework under test, described by a small TOML file.

    name = "megatron-lm"            # how reports call it
    path = "~/src/Megatron-LM"      # the user's git checkout (relative paths: from the TOML file)
    commit = "aa5bf2c..."           # what every attempt checks out (a sha, tag or branch)
    launch_notes = "..."            # how to launch it here; shown to the agent after each prompt
    data_root = "/data/ate-bench"   # where relative [staged_data] paths live (optional; this default;
                                    # the ATE_BENCH_DATA environment variable overrides it)
    [staged_data]                   # pre-staged inputs the tasks may need, name -> path
    train_data = "fineweb-edu-10M"
    [stage]                         # how `ate-bench stage` makes a staged input here (optional):
    train_data = "cmd ... {path}"   # a shell command run in `path`, {path} the input's path
    [scripted]                      # the reference procedure of a task for `--agent scripted`
    op-01 = "cmd ..."               # (optional): a shell command run in the attempt's worktree;
                                    # {framework_dir} and the staged names are substituted
    [env]                           # extra environment variables for the agent (optional)

The harness never runs an agent in `path` itself: each attempt gets its own worktree.
"""

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ate_bench.tasks import check_keys

KEYS = {"name", "path", "commit", "launch_notes", "data_root", "staged_data", "stage", "scripted", "env"}
TABLES = ("staged_data", "stage", "scripted", "env")
DATA_ROOT = "/data/ate-bench"


@dataclass(frozen=True)
class Framework:
    name: str
    path: Path
    commit: str
    launch_notes: str
    staged_data: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    stage: dict[str, str] = field(default_factory=dict)
    scripted: dict[str, str] = field(default_factory=dict)
    toml: Path = Path("framework.toml")  # the file it was read from

    def notes_for_agent(self) -> str:
        lines = [f"Framework notes ({self.name}):", self.launch_notes.strip()]
        if self.staged_data:
            lines.append("Pre-staged data (name: path):")
            lines += [f"  {name}: {path}" for name, path in sorted(self.staged_data.items())]
        return "\n".join(lines) + "\n"


def load_framework(path: Path) -> Framework:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"expected a framework TOML file, got {str(path)!r}: no such file")
    data = tomllib.loads(path.read_text())
    check_keys(str(path), data, KEYS, {"name", "path", "commit", "launch_notes"})
    for key in ("name", "path", "commit", "launch_notes"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise ValueError(f"{path}: expected a non-empty string for {key!r}, got {data[key]!r}")
    for key in TABLES:
        table = data.get(key, {})
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
            raise ValueError(f"{path}: expected a table of strings [{key}], got {table!r}")
    unknown = set(data.get("stage", {})) - set(data.get("staged_data", {}))
    if unknown:
        raise ValueError(
            f"{path}: expected [stage] entries for names in [staged_data], got {sorted(unknown)}"
        )
    checkout = Path(os.path.expanduser(data["path"]))
    if not checkout.is_absolute():
        checkout = (path.parent / checkout).resolve()
    root = Path(os.path.expanduser(os.environ.get("ATE_BENCH_DATA") or data.get("data_root", DATA_ROOT)))
    staged = {k: str(root / os.path.expanduser(v)) for k, v in data.get("staged_data", {}).items()}
    return Framework(
        name=data["name"],
        path=checkout,
        commit=data["commit"].strip(),
        launch_notes=data["launch_notes"],
        staged_data=staged,
        env=dict(data.get("env", {})),
        stage=dict(data.get("stage", {})),
        scripted=dict(data.get("scripted", {})),
        toml=path.resolve(),
    )
