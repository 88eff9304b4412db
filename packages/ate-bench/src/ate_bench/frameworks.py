"""A framework under test, described by a small TOML file.

    name = "megatron-lm"            # how reports call it
    path = "~/src/Megatron-LM"      # the user's git checkout (relative paths: from the TOML file)
    commit = "aa5bf2c..."           # what every attempt checks out (a sha, tag or branch)
    launch_notes = "..."            # how to launch it here; shown to the agent after each prompt
    [staged_data]                   # pre-staged inputs the tasks may need, name -> path
    train_data = "/data/..."
    [env]                           # extra environment variables for the agent (optional)

The harness never runs an agent in `path` itself: each attempt gets its own worktree.
"""

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ate_bench.tasks import check_keys

KEYS = {"name", "path", "commit", "launch_notes", "staged_data", "env"}


@dataclass(frozen=True)
class Framework:
    name: str
    path: Path
    commit: str
    launch_notes: str
    staged_data: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

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
    for key in ("staged_data", "env"):
        table = data.get(key, {})
        if not all(isinstance(v, str) for v in table.values()):
            raise ValueError(f"{path}: expected string values in [{key}], got {table!r}")
    checkout = Path(os.path.expanduser(data["path"]))
    if not checkout.is_absolute():
        checkout = (path.parent / checkout).resolve()
    staged = {k: os.path.expanduser(v) for k, v in data.get("staged_data", {}).items()}
    return Framework(
        name=data["name"],
        path=checkout,
        commit=data["commit"].strip(),
        launch_notes=data["launch_notes"],
        staged_data=staged,
        env=dict(data.get("env", {})),
    )
