"""`--agent scripted`: a built-in stand-in for a coding agent that runs each task's reference
procedure from the framework TOML's [scripted] table, to check the harness, the staged data and
the graders on a machine before a real agent spends money there. It is a self-test, not a
measurement: it reads nothing, decides nothing, and its transcript reports zero tokens.

The runner starts `python -m ate_bench.scripted PROCEDURES_JSON` in the attempt's worktree with the
task id in $ATE_TASK. The procedure whose key is the task id or its prefix (`op-01` for
`op-01-getting-started`) runs under `bash -eo pipefail`; stdout is a Claude stream-json transcript
(one Bash tool call, its output's tail, a result event), the exit status the procedure's.
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

OUTPUT_TAIL = 4000  # characters of the procedure's output kept in the transcript


@dataclass(frozen=True)
class Scripted:
    procedures: dict[str, str] = field(default_factory=dict)  # task id or prefix -> shell command
    name: str = "scripted"

    def command(self, prompt: str, read_only: bool, worktree: Path, prompt_file: Path) -> list[str]:
        return [sys.executable, "-m", "ate_bench.scripted", json.dumps(self.procedures)]


def scripted_agent(framework) -> Scripted:
    """The scripted agent of a framework: its [scripted] procedures with {framework_dir} and the
    staged input names filled in."""
    if not framework.scripted:
        raise ValueError(
            f"expected a [scripted] table of reference procedures in the {framework.name} TOML for "
            "--agent scripted, got none"
        )
    names = {"framework_dir": str(framework.toml.parent)} | framework.staged_data
    try:
        return Scripted({key: command.format(**names) for key, command in framework.scripted.items()})
    except KeyError as error:
        raise ValueError(
            f"expected the {framework.name} [scripted] procedures to use only {{framework_dir}} and the "
            f"[staged_data] names {sorted(framework.staged_data)}, got {{{error.args[0]}}}"
        ) from None


def procedure_for(procedures: dict[str, str], task_id: str) -> str | None:
    keys = [key for key in procedures if task_id == key or task_id.startswith(key + "-")]
    return procedures[max(keys, key=len)] if keys else None


def emit(event: dict) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str]) -> int:
    procedures, task_id = json.loads(argv[0]), os.environ.get("ATE_TASK", "")
    started = time.monotonic()
    emit({"type": "system", "subtype": "init", "cwd": os.getcwd(), "agent": "ate-bench scripted"})
    command = procedure_for(procedures, task_id)
    if command is None:
        text, status = f"no scripted procedure for {task_id!r} (have {sorted(procedures)})", 1
    else:
        usage = {"input_tokens": 0, "output_tokens": 0}
        call = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": command}}
        emit({"type": "assistant", "message": {"id": "scripted_1", "content": [call], "usage": usage}})
        done = subprocess.run(
            ["bash", "-eo", "pipefail", "-c", command],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
        output = (done.stdout + done.stderr)[-OUTPUT_TAIL:]
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": output}
        emit({"type": "user", "message": {"content": [result | {"is_error": done.returncode != 0}]}})
        status = done.returncode
        text = f"ran the reference procedure for {task_id}: exit status {status}"
    emit({
        "type": "result", "subtype": "success" if status == 0 else "error", "is_error": status != 0,
        "duration_ms": round((time.monotonic() - started) * 1000), "num_turns": 1 if command is None else 2,
        "result": text, "modelUsage": {},
    })  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
