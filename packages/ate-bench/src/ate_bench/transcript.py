"""Per-attempt metrics read from an agent transcript (JSON lines).

Two formats are understood, told apart by their event types:
- Claude Code `--output-format stream-json`: `system`, `assistant`, `user`, and a final `result`
  event. The headline metrics are defined on the `result` event exactly:
    agent_turns        = result.num_turns
    output_tokens      = sum over result.modelUsage of outputTokens
    per_turn_context   = sum over result.modelUsage of
                         (inputTokens + cacheReadInputTokens + cacheCreationInputTokens) / agent_turns
    session_duration_s = result.duration_ms / 1000
  Without a result event (crash, timeout) the same figures are rebuilt from the assistant
  messages (one turn per distinct message id; tokens from each message's usage, counted once) and
  the metrics carry `complete: false`; the duration is then unknown (null) unless the caller knows
  the wall-clock time.
- Codex CLI `exec --json`: `thread.started`, `turn.*`, `item.*`. Codex reports usage per user turn,
  not per model call, so agent_turns is the number of completed agent items (commands, file
  changes, messages, tool calls) and the context figure is total input tokens over those items.

Tool calls are classified by what they do: exploring (reading, searching, listing), editing
(writing files) or running (executing commands). A shell command whose program only reads
(`cat`, `rg`, `ls`, `git log`, ...) counts as exploring.
"""

import json
import re
import shlex
from pathlib import Path

EXPLORING_TOOLS = {"Read", "Grep", "Glob", "LS", "NotebookRead", "WebFetch", "WebSearch"}
EDITING_TOOLS = {"Edit", "MultiEdit", "Write", "NotebookEdit"}
RUNNING_TOOLS = {"Bash", "BashOutput", "KillShell", "KillBash"}
READ_ONLY_PROGRAMS = {
    "cat", "head", "tail", "less", "grep", "rg", "ag", "find", "fd", "ls", "tree", "wc", "file",
    "stat", "du", "pwd", "nl", "sed", "awk", "diff", "realpath", "readlink", "which",
}  # fmt: skip
READ_ONLY_GIT = {"log", "show", "diff", "grep", "blame", "ls-files", "status", "rev-parse"}
SHELL_WRAPPERS = {"bash", "sh", "zsh"}
REDIRECT = re.compile(r"^[0-9&]?>>?(.*)$")


def classify_command(command: str) -> str:
    """'exploring' if every program in a shell pipeline only reads, else 'running'."""
    try:
        words = shlex.split(command)
    except ValueError:
        return "running"
    # `bash -lc "..."` (Codex wraps every command this way): classify the inner script.
    if len(words) >= 3 and words[0].rsplit("/", 1)[-1] in SHELL_WRAPPERS and words[1] in ("-c", "-lc"):
        return classify_command(words[2])
    segments, current = [], []
    for word in words:
        if word in ("|", "&&", "||", ";"):
            segments.append(current)
            current = []
        else:
            current.append(word)
    segments.append(current)
    for segment in segments:
        if not segment:
            continue
        program = segment[0].rsplit("/", 1)[-1]
        if program == "git":
            if len(segment) < 2 or segment[1] not in READ_ONLY_GIT:
                return "running"
        elif program == "sed":
            if "-i" in segment or not any(w.startswith("-n") for w in segment[1:]):
                return "running"
        elif program not in READ_ONLY_PROGRAMS:
            return "running"
        if writes_a_file(segment):
            return "running"
    return "exploring"


def writes_a_file(words: list[str]) -> bool:
    """True for an output redirection to anything but /dev/null or another descriptor."""
    for i, word in enumerate(words):
        match = REDIRECT.match(word)
        if match:
            target = match.group(1) or (words[i + 1] if i + 1 < len(words) else "")
            if target != "/dev/null" and not target.startswith("&"):
                return True
    return False


def classify_claude_tool(name: str, tool_input: dict) -> str:
    if name in EXPLORING_TOOLS:
        return "exploring"
    if name in EDITING_TOOLS:
        return "editing"
    if name in RUNNING_TOOLS:
        command = tool_input.get("command")
        return classify_command(command) if name == "Bash" and isinstance(command, str) else "running"
    return "other"


def read_events(path: Path) -> tuple[list[dict], int]:
    """The JSON objects in a JSONL file and how many lines were not JSON (a cut-off last line)."""
    events, bad_lines = [], 0
    for line in Path(path).read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            bad_lines += 1
            continue
        if isinstance(event, dict):
            events.append(event)
        else:
            bad_lines += 1
    return events, bad_lines


def empty_tool_calls() -> dict:
    return {"exploring": 0, "editing": 0, "running": 0, "other": 0}


def claude_metrics(events: list[dict]) -> dict:
    tool_calls = empty_tool_calls()
    seen_tool_ids = set()
    message_usage = {}  # message id -> usage (stream-json repeats a message once per content block)
    final_text = None
    for event in events:
        if event.get("type") != "assistant":
            continue
        message = event.get("message") or {}
        message_usage[message.get("id") or id(message)] = message.get("usage") or {}
        for block in message.get("content") or []:
            if block.get("type") == "tool_use" and block.get("id") not in seen_tool_ids:
                seen_tool_ids.add(block.get("id"))
                tool_calls[classify_claude_tool(block.get("name", ""), block.get("input") or {})] += 1
            elif block.get("type") == "text":
                final_text = block.get("text", "")
    result = next((e for e in reversed(events) if e.get("type") == "result"), None)
    if result is not None:
        model_usage = result.get("modelUsage") or {}
        turns = int(result.get("num_turns") or 0)
        output_tokens = sum(int(u.get("outputTokens", 0)) for u in model_usage.values())
        context = sum(
            int(u.get("inputTokens", 0))
            + int(u.get("cacheReadInputTokens", 0))
            + int(u.get("cacheCreationInputTokens", 0))
            for u in model_usage.values()
        )
        duration = result["duration_ms"] / 1000 if "duration_ms" in result else None
        if isinstance(result.get("result"), str):
            final_text = result["result"]
        is_error = bool(result.get("is_error"))
    else:
        turns = len(message_usage)
        output_tokens = sum(int(u.get("output_tokens", 0)) for u in message_usage.values())
        context = sum(
            int(u.get("input_tokens", 0))
            + int(u.get("cache_read_input_tokens", 0))
            + int(u.get("cache_creation_input_tokens", 0))
            for u in message_usage.values()
        )
        duration, is_error = None, None
    return {
        "format": "claude-code",
        "complete": result is not None,
        "is_error": is_error,
        "agent_turns": turns,
        "output_tokens": output_tokens,
        "per_turn_context": context / turns if turns else None,
        "session_duration_s": duration,
        "tool_calls": tool_calls,
        "final_text": final_text,
    }


def codex_metrics(events: list[dict]) -> dict:
    tool_calls = empty_tool_calls()
    input_tokens = output_tokens = items = 0
    final_text, complete, is_error = None, False, False
    for event in events:
        kind = event.get("type")
        if kind == "turn.completed":
            usage = event.get("usage") or {}
            input_tokens += int(usage.get("input_tokens", 0))
            output_tokens += int(usage.get("output_tokens", 0))
            complete = True
        elif kind in ("turn.failed", "error"):
            is_error = True
        elif kind == "item.completed":
            item = event.get("item") or {}
            item_type = item.get("type")
            if item_type == "reasoning":
                continue
            items += 1
            if item_type == "command_execution":
                tool_calls[classify_command(item.get("command", ""))] += 1
            elif item_type == "file_change":
                tool_calls["editing"] += 1
            elif item_type == "agent_message":
                final_text = item.get("text", final_text)
            elif item_type in ("mcp_tool_call", "web_search"):
                tool_calls["exploring" if item_type == "web_search" else "other"] += 1
    return {
        "format": "codex",
        "complete": complete,
        "is_error": is_error if complete else None,
        "agent_turns": items,
        "output_tokens": output_tokens,
        "per_turn_context": input_tokens / items if items else None,
        "session_duration_s": None,
        "tool_calls": tool_calls,
        "final_text": final_text,
    }


def transcript_metrics(path: Path) -> dict:
    """Metrics of one transcript; see the module docstring for the definitions."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"expected a transcript file (JSON lines), got {str(path)!r}: no such file")
    events, bad_lines = read_events(path)
    is_codex = any(str(e.get("type", "")).startswith(("thread.", "turn.", "item.")) for e in events)
    metrics = codex_metrics(events) if is_codex else claude_metrics(events)
    metrics["unparsed_lines"] = bad_lines
    return metrics
