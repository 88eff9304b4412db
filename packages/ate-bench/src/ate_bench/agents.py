"""How each agent is launched on one attempt.

An adapter turns (prompt, read-only?, worktree, prompt file) into the command to run; the runner
starts it in the worktree, sends its stdout to transcript.jsonl and its stderr to agent.stderr.
- Claude Code: `claude -p PROMPT --output-format stream-json --verbose`; Q&A gets only the
  read-only tools (Read, Grep, Glob, LS), everything else may edit and run without asking.
- Codex CLI: `codex exec --json`; Q&A in the read-only sandbox, everything else unsandboxed (the
  worktree is the isolation; GPU jobs need device access the write sandbox may deny).
- Scripted (`--agent scripted`): the framework TOML's reference procedures (scripted.py), a
  self-test of the harness and the graders, not a measurement.
- Generic: a shell command template with {prompt_file}, {worktree} and {read_only} (1 or 0);
  its stdout is the transcript, so an agent that writes Claude stream-json gets full metrics.
"""

import shlex
from dataclasses import dataclass
from pathlib import Path

from ate_bench.scripted import scripted_agent

CLAUDE_READ_ONLY_TOOLS = "Read,Grep,Glob,LS"
CLAUDE_WRITE_TOOLS = "Bash,Edit,MultiEdit,Write,NotebookEdit,WebFetch,WebSearch"


@dataclass(frozen=True)
class ClaudeCode:
    executable: str = "claude"
    model: str | None = None
    name: str = "claude-code"

    def command(self, prompt: str, read_only: bool, worktree: Path, prompt_file: Path) -> list[str]:
        argv = [self.executable, "-p", prompt, "--output-format", "stream-json", "--verbose"]
        if self.model:
            argv += ["--model", self.model]
        if read_only:
            return argv + ["--allowedTools", CLAUDE_READ_ONLY_TOOLS, "--disallowedTools", CLAUDE_WRITE_TOOLS]
        return argv + ["--permission-mode", "bypassPermissions"]


@dataclass(frozen=True)
class Codex:
    executable: str = "codex"
    model: str | None = None
    name: str = "codex"

    def command(self, prompt: str, read_only: bool, worktree: Path, prompt_file: Path) -> list[str]:
        argv = [self.executable, "exec", "--json", "--cd", str(worktree)]
        if self.model:
            argv += ["--model", self.model]
        access = ["--sandbox", "read-only"] if read_only else ["--dangerously-bypass-approvals-and-sandbox"]
        return argv + access + [prompt]


@dataclass(frozen=True)
class Generic:
    template: str
    name: str = "generic"

    def __post_init__(self):
        if "{prompt_file}" not in self.template:
            raise ValueError(
                f"expected the agent command template to use {{prompt_file}}, got {self.template!r}"
            )

    def command(self, prompt: str, read_only: bool, worktree: Path, prompt_file: Path) -> str:
        return self.template.format(
            prompt_file=shlex.quote(str(prompt_file)),
            worktree=shlex.quote(str(worktree)),
            read_only="1" if read_only else "0",
        )


def make_agent(name: str, command: str | None = None, model: str | None = None, framework=None):
    """The adapter for `--agent NAME` (claude, codex, scripted: needs the framework) or a generic
    `--agent-command TEMPLATE`."""
    if command:
        return Generic(command, name=name)
    if name == "claude":
        return ClaudeCode(model=model)
    if name == "codex":
        return Codex(model=model)
    if name == "scripted" and framework is not None:
        return scripted_agent(framework)
    raise ValueError(
        f"expected --agent claude, codex or scripted, or an --agent-command template, got {name!r}"
    )
