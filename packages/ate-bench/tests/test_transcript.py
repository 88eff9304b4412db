"""Metrics of transcripts in Claude Code's stream-json format (and Codex's exec --json), written
for these tests under data/; expected values worked out by hand from the files."""

import json
from pathlib import Path

import pytest
from ate_bench.cli import main
from ate_bench.transcript import classify_command, transcript_metrics

DATA = Path(__file__).parent / "data"


def test_complete_transcript_uses_the_result_event_definitions():
    m = transcript_metrics(DATA / "claude_complete.jsonl")
    assert m["complete"] is True and m["is_error"] is False
    assert m["agent_turns"] == 6  # result.num_turns
    assert m["output_tokens"] == 900 + 100  # outputTokens summed over both models in modelUsage
    assert m["per_turn_context"] == pytest.approx((20 + 30000 + 6000 + 1000) / 6)
    assert m["session_duration_s"] == pytest.approx(45.25)
    assert m["tool_calls"] == {"exploring": 3, "editing": 1, "running": 1, "other": 0}
    assert "init_process_group" in m["final_text"]


def test_transcript_without_result_event_still_counts_and_is_flagged():
    m = transcript_metrics(DATA / "claude_truncated.jsonl")
    assert m["complete"] is False and m["unparsed_lines"] == 1
    assert m["agent_turns"] == 4  # distinct assistant message ids; msg_01 appears twice
    assert m["output_tokens"] == 31 + 58 + 44 + 39  # msg_01's usage counted once
    context = (4 + 5200) + (6 + 420 + 5200) + (6 + 300 + 5620) + (6 + 250 + 5920)
    assert m["per_turn_context"] == pytest.approx(context / 4)
    assert m["session_duration_s"] is None
    assert m["tool_calls"]["running"] == 1 and m["tool_calls"]["editing"] == 0


def test_codex_transcript():
    m = transcript_metrics(DATA / "codex.jsonl")
    assert m["format"] == "codex" and m["complete"] is True
    assert m["agent_turns"] == 4 and m["output_tokens"] == 122
    assert m["tool_calls"] == {"exploring": 1, "editing": 1, "running": 1, "other": 0}


@pytest.mark.parametrize(
    ("command", "kind"),
    [
        ("rg -n foo | head -5", "exploring"),
        ("git log --oneline -3", "exploring"),
        ("sed -n '1,40p' model.py", "exploring"),
        ("bash -lc 'cat a.py && ls'", "exploring"),
        ("sed -i s/a/b/ model.py", "running"),
        ("find . -name '*.py' 2>/dev/null | wc -l", "exploring"),
        ("grep -rn x . 2>&1 | head", "exploring"),
        ("cat a > b", "running"),
        ("cat a 2>err.log", "running"),
        ("python train.py", "running"),
        ("git commit -am x", "running"),
    ],
)
def test_shell_commands_are_classified_by_what_they_do(command, kind):
    assert classify_command(command) == kind


def test_metrics_command_prints_the_issue_keys(tmp_path, capsys):
    transcript = tmp_path / "transcript.jsonl"
    transcript.write_text((DATA / "claude_complete.jsonl").read_text())
    (tmp_path / "gpu.json").write_text(json.dumps({"active_gpu_time_s": 12.5}))
    assert main(["metrics", str(transcript)]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = {"agent_turns", "output_tokens", "per_turn_context", "session_duration_s", "active_gpu_time_s"}
    assert expected <= set(printed) and printed["active_gpu_time_s"] == 12.5
    assert set(printed["tool_calls"]) >= {"exploring", "editing", "running"}


def test_metrics_of_a_missing_file_is_an_error(tmp_path, capsys):
    assert main(["metrics", str(tmp_path / "nope.jsonl")]) == 2
    assert "expected a transcript file" in capsys.readouterr().err
