"""`ate-bench report` and `ate-bench compare`: medians over the attempts of a run directory.

report: one row per (framework, agent, task): the median of every metric over its attempts, the
number of attempts, timeouts and PASS / NEEDS_HUMAN / NEEDS_JUDGE verdicts; written as
report.md, report.csv and report.png (median output tokens and wall-clock time per task, one bar
per framework and agent; wall-clock rather than session time, which a timed-out attempt lacks),
plus grading-sheet.csv for the human grader of the Q&A answers.
compare: for each task, (median of framework - median of baseline) / median of baseline, and the
same over the sum of the medians of all tasks both ran.
"""

import csv
import json
import statistics
from pathlib import Path

METRICS = (
    "agent_turns", "output_tokens", "per_turn_context", "session_duration_s", "active_gpu_time_s",
    "wall_s", "tool_exploring", "tool_editing", "tool_running",
)  # fmt: skip
SHEET_FIELDS = (
    "framework", "agent", "task", "attempt", "question", "reference", "answer", "citations_valid",
    "citations_total", "citation_problems", "worktree", "grade (correct / partial / wrong)", "notes",
)  # fmt: skip


def load_results(run_dir: Path) -> list[dict]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"expected a run directory, got {str(run_dir)!r}: no such directory")
    # RUN/<framework>/<agent>/<task>/attempt-<n>/result.json, never a file of a worktree
    files = sorted(run_dir.glob("*/*/*/attempt-*/result.json"))
    return [json.loads(p.read_text()) | {"path": str(p.parent)} for p in files]


def flat_metrics(record: dict) -> dict:
    metrics = record["metrics"]
    calls = metrics.get("tool_calls", {})
    return {
        **{k: metrics.get(k) for k in METRICS if not k.startswith("tool_") and k != "wall_s"},
        "wall_s": record.get("wall_s"),
        "tool_exploring": calls.get("exploring"),
        "tool_editing": calls.get("editing"),
        "tool_running": calls.get("running"),
    }


def median(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarise(records: list[dict]) -> list[dict]:
    groups = {}
    for record in records:
        groups.setdefault((record["framework"], record["agent"], record["task"]), []).append(record)
    rows = []
    for (framework, agent, task), group in sorted(groups.items()):
        flats = [flat_metrics(r) for r in group]
        verdicts = [r["grade"]["verdict"] for r in group]
        rows.append(
            {
                "framework": framework,
                "agent": agent,
                "task": task,
                "category": group[0]["category"],
                "attempts": len(group),
                "timeouts": sum(r["status"] == "timeout" for r in group),
                "pass": verdicts.count("PASS"),
                "needs_human": verdicts.count("NEEDS_HUMAN"),
                "needs_judge": verdicts.count("NEEDS_JUDGE"),
                **{m: median(f[m] for f in flats) for m in METRICS},
            }
        )
    return rows


def format_value(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.1f}"
    return f"{int(value)}"


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append(
            "| "
            + " | ".join(v if isinstance(v, str) else format_value(v) for v in map(row.get, columns))
            + " |"
        )
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: list[dict], columns) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a benchmark machine
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows})
    series = sorted({(r["framework"], r["agent"]) for r in rows})
    by_key = {(r["framework"], r["agent"], r["task"]): r for r in rows}
    figure, axes = plt.subplots(2, 1, figsize=(max(8, 0.6 * len(tasks) * len(series)), 8), sharex=True)
    width = 0.8 / len(series)
    for axis, metric, label in zip(axes, ("output_tokens", "wall_s"), ("output tokens", "wall-clock s")):
        for i, (framework, agent) in enumerate(series):
            values = [(by_key.get((framework, agent, t)) or {}).get(metric) or 0 for t in tasks]
            axis.bar(
                [x + i * width for x in range(len(tasks))], values, width, label=f"{framework} / {agent}"
            )
        axis.set_ylabel(f"median {label}")
    axes[0].legend(fontsize=8)
    axes[1].set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(tasks))])
    axes[1].set_xticklabels(tasks, rotation=60, ha="right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def grading_sheet(records: list[dict], path: Path, questions: dict[str, tuple[str, str]]) -> int:
    """One row per Q&A attempt for the human grader; returns the number of rows."""
    rows = []
    for r in records:
        if r["category"] != "qa":
            continue
        grade = r["grade"]
        problems = [f"{c['citation']}: {c['reason']}" for c in grade.get("citations", []) if not c["ok"]]
        question, reference = questions.get(r["task"], ("", ""))
        rows.append(
            {
                "framework": r["framework"],
                "agent": r["agent"],
                "task": r["task"],
                "attempt": r["repeat"],
                "question": question,
                "reference": reference,
                "answer": grade.get("answer") or "",
                "citations_valid": grade.get("citations_valid", 0),
                "citations_total": grade.get("citations_total", 0),
                "citation_problems": "; ".join(problems) or grade.get("reason", ""),
                "worktree": str(Path(r["path"]) / "worktree"),
            }
        )
    write_csv(path, rows, SHEET_FIELDS)
    return len(rows)


def write_report(run_dir: Path, out_dir: Path, questions: dict[str, tuple[str, str]]) -> dict:
    records = load_results(run_dir)
    if not records:
        raise ValueError(f"expected finished attempts (result.json) under {run_dir}, got none")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarise(records)
    columns = [
        "framework",
        "agent",
        "task",
        "attempts",
        "timeouts",
        "pass",
        "needs_human",
        "needs_judge",
        *METRICS,
    ]
    (out_dir / "report.md").write_text(
        f"# ATE-Bench report\n\n{len(records)} attempts; medians over the attempts of each task.\n\n"
        + markdown_table(rows, columns)
    )
    write_csv(out_dir / "report.csv", rows, columns)
    plot(rows, out_dir / "report.png")
    sheet_rows = grading_sheet(records, out_dir / "grading-sheet.csv", questions)
    return {"attempts": len(records), "rows": rows, "sheet_rows": sheet_rows, "out_dir": str(out_dir)}


def relative(value, base) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return (value - base) / base


def compare(run_dir: Path, baseline: str | None = None) -> tuple[str, list[dict]]:
    """Markdown and rows of relative differences of every framework against the baseline."""
    rows = summarise(load_results(run_dir))
    frameworks = sorted({r["framework"] for r in rows})
    if len(frameworks) < 2:
        raise ValueError(f"expected results of at least two frameworks to compare, got {frameworks}")
    baseline = baseline or frameworks[0]
    if baseline not in frameworks:
        raise ValueError(f"expected --baseline in {frameworks}, got {baseline!r}")
    base = {(r["agent"], r["task"]): r for r in rows if r["framework"] == baseline}
    out, totals = [], {}
    for row in rows:
        reference = base.get((row["agent"], row["task"]))
        if row["framework"] == baseline or reference is None:
            continue
        out.append(
            {"framework": row["framework"], "agent": row["agent"], "task": row["task"]}
            | {m: relative(row[m], reference[m]) for m in METRICS}
        )
        # Over all shared tasks: the sum of the medians, where both frameworks have the metric.
        sums = totals.setdefault((row["framework"], row["agent"]), {m: [0.0, 0.0] for m in METRICS})
        for m in METRICS:
            if row[m] is not None and reference[m] is not None:
                sums[m][0] += row[m]
                sums[m][1] += reference[m]
    for (framework, agent), sums in sorted(totals.items()):
        out.append(
            {"framework": framework, "agent": agent, "task": "(all shared tasks)"}
            | {m: relative(*sums[m]) for m in METRICS}
        )
    shown = [{k: (f"{v * 100:+.0f}%" if isinstance(v, float) else v) for k, v in r.items()} for r in out]
    text = (
        f"# Relative to {baseline}\n\n(framework median - {baseline} median) / {baseline} median, per task; "
        "negative = the framework cost the agent less.\n\n"
        + markdown_table(shown, ["framework", "agent", "task", *METRICS])
    )
    return text, out
