"""The `ate-bench` command line: run, stage, doctor, report, compare, metrics, inspect, tasks."""

import argparse
import json
import sys
from pathlib import Path

from ate_bench.agents import make_agent
from ate_bench.doctor import format_checks, run_checks
from ate_bench.frameworks import load_framework
from ate_bench.gpu import SCOPES
from ate_bench.inspect_repo import (
    format_table,
    framework_lines,
    inspect_tree,
    readme_table,
    write_readme_table,
)
from ate_bench.report import compare, write_report
from ate_bench.runner import MAX_DISK_GB, run_suite
from ate_bench.staging import stage
from ate_bench.tasks import load_tasks, select_tasks
from ate_bench.transcript import transcript_metrics


def chosen_tasks(args):
    return select_tasks(load_tasks(), [t for arg in args.tasks for t in arg.split(",") if t])


def cmd_run(args) -> int:
    framework = load_framework(args.framework)
    tasks = chosen_tasks(args)
    name = args.agent_name or ("generic" if args.agent_command else args.agent)
    agent = make_agent(name if args.agent_command else args.agent, args.agent_command, args.model, framework)
    if args.stage:
        stage(framework, tasks)
    records = run_suite(
        framework, tasks, agent, Path(args.run_dir), args.repeats, args.timeout, args.judge, args.gpu_scope,
        max_disk_gb=args.max_disk_gb, keep_outputs=args.keep_outputs,
    )  # fmt: skip
    verdicts = [r["grade"]["verdict"] for r in records]
    disks = [r.get("disk") or {"owned_bytes": 0, "kept_bytes": 0} for r in records]
    print(
        f"{len(records)} attempts in {args.run_dir}: "
        + ", ".join(f"{v} {verdicts.count(v)}" for v in sorted(set(verdicts)))
        + f"; disk per attempt at most {max(d['owned_bytes'] for d in disks) / 2**20:.0f} MB while it ran,"
        f" {sum(d['kept_bytes'] for d in disks) / 2**20:.0f} MB kept in all"
    )
    return 0


def cmd_stage(args) -> int:
    framework = load_framework(args.framework)
    made = stage(framework, chosen_tasks(args))
    print("\n".join(f"staged {path}" for path in made) or "nothing to stage: every input is there")
    return 0


def cmd_doctor(args) -> int:
    framework = load_framework(args.framework) if args.framework else None
    checks = run_checks(framework, chosen_tasks(args) if framework else (), Path(args.run_dir), args.agent)
    print(format_checks(checks), end="")
    return 1 if any(level == "FAIL" for level, _, _ in checks) else 0


def cmd_report(args) -> int:
    questions = {t.id: (t.question, t.grading.get("reference", "")) for t in load_tasks()}
    summary = write_report(Path(args.run_dir), Path(args.out or args.run_dir), questions)
    print((Path(summary["out_dir"]) / "report.md").read_text())
    print(
        f"wrote report.md, report.csv, report.png and grading-sheet.csv "
        f"({summary['sheet_rows']} Q&A rows) in {summary['out_dir']}"
    )
    return 0


def cmd_compare(args) -> int:
    text, _ = compare(Path(args.run_dir), args.baseline)
    print(text)
    return 0


def cmd_metrics(args) -> int:
    path = Path(args.transcript)
    metrics = transcript_metrics(path)
    metrics.pop("final_text")
    gpu_file = path.parent / "gpu.json"  # written by `ate-bench run` beside the transcript
    metrics["active_gpu_time_s"] = (
        json.loads(gpu_file.read_text())["active_gpu_time_s"] if gpu_file.is_file() else None
    )
    print(json.dumps(metrics, indent=2))
    return 0


def cmd_inspect(args) -> int:
    report = inspect_tree(Path(args.path))
    if args.check_budget:
        f = report["framework"]
        print(
            "\n".join(framework_lines(f)) if f["budget"] else "no [tool.ate-bench] budget in pyproject.toml"
        )
        return 0 if f["within_budget"] else 1
    if args.readme:
        if args.check:
            stale = readme_table(Path(args.readme)) != format_table(report)
            print(f"{args.readme}: the inspect table is {'stale' if stale else 'current'}")
            return 1 if stale else 0
        changed = False
        # The README may lie in the tree, its own lines counted: write until the table holds still.
        while write_readme_table(Path(args.readme), format_table(report)):
            changed, report = True, inspect_tree(Path(args.path))
        print(f"{args.readme}: inspect table {'updated' if changed else 'already current'}")
        return 0
    print(
        json.dumps(report, indent=2) if args.json else format_table(report), end="" if not args.json else "\n"
    )
    return 0


def cmd_tasks(args) -> int:
    for task in load_tasks():
        print(f"{task.id:<26}{task.category:<10}{task.time_limit_s:>7.0f}s  {task.title}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ate-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the tasks with one agent on one framework (resumes)")
    run.add_argument("--framework", required=True, help="framework TOML (see frameworks/)")
    run.add_argument(
        "--tasks",
        action="append",
        default=[],
        help="task ids, id prefixes or categories (qa, operate, feature); comma-separated or repeated; "
        "default all",
    )
    run.add_argument(
        "--agent",
        default="claude",
        help="claude, codex, or scripted (the framework TOML's reference procedures: a self-test of the "
        "harness and graders, not a measurement); ignored with --agent-command",
    )
    run.add_argument(
        "--agent-command", help="generic agent: shell template using {prompt_file}, {worktree}, {read_only}"
    )
    run.add_argument(
        "--agent-name", help="name of the agent in results (default: the --agent value, or 'generic')"
    )
    run.add_argument("--model", help="model passed to the claude / codex CLI")
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--run-dir", default="ate-runs", help="where attempts, worktrees and results go")
    run.add_argument(
        "--timeout", type=float, help="per-attempt wall-clock limit in seconds (default: per category)"
    )
    run.add_argument(
        "--judge", help="judge for new-feature tasks: shell template using {prompt_file}, {worktree}"
    )
    run.add_argument(
        "--gpu-scope",
        choices=SCOPES,
        default="attempt",
        help="count GPUs running the attempt's processes, or all busy GPUs",
    )
    run.add_argument(
        "--stage", action="store_true", help="first make the missing inputs the TOML has [stage] recipes for"
    )
    run.add_argument(
        "--max-disk-gb", type=float, default=MAX_DISK_GB,
        help="end an attempt whose own files pass this many GB (default %(default)s)",
    )  # fmt: skip
    run.add_argument(
        "--keep-outputs", action="store_true",
        help="keep what git ignores in attempts' worktrees (environments, checkpoints) after grading",
    )  # fmt: skip
    run.set_defaults(handler=cmd_run)

    stg = sub.add_parser("stage", help="make the missing pre-staged inputs of tasks ([stage] in the TOML)")
    stg.add_argument("tasks", nargs="*", default=[], help="task ids, prefixes or categories; default all")
    stg.add_argument("--framework", required=True, help="framework TOML")
    stg.set_defaults(handler=cmd_stage)

    doc = sub.add_parser("doctor", help="check agent CLIs, git, GPU sampling, package cache, staged data")
    doc.add_argument("--framework", help="also check this framework TOML's checkout and staged inputs")
    doc.add_argument(
        "--tasks", action="append", default=[], help="the tasks whose inputs to check (default all)"
    )
    doc.add_argument("--agent", help="the agent you will run (its CLI missing is then a FAIL)")
    doc.add_argument("--run-dir", default="ate-runs", help="where the run will go (for the cache check)")
    doc.set_defaults(handler=cmd_doctor)

    report = sub.add_parser(
        "report", help="medians per task and framework: Markdown, CSV, PNG, grading sheet"
    )
    report.add_argument("run_dir")
    report.add_argument("--out", help="output directory (default: the run directory)")
    report.set_defaults(handler=cmd_report)

    comp = sub.add_parser("compare", help="relative differences between frameworks")
    comp.add_argument("run_dir")
    comp.add_argument("--baseline", help="framework the others are compared with (default: first by name)")
    comp.set_defaults(handler=cmd_compare)

    metrics = sub.add_parser("metrics", help="metrics of one transcript, as JSON")
    metrics.add_argument("transcript")
    metrics.set_defaults(handler=cmd_metrics)

    insp = sub.add_parser("inspect", help="agent-native figures of a checkout")
    insp.add_argument("path")
    insp.add_argument("--json", action="store_true")
    insp.add_argument("--readme", help="write the table into this README's <!-- inspect --> block instead")
    insp.add_argument("--check", action="store_true", help="with --readme: exit 1 if the block is stale")
    insp.add_argument(
        "--check-budget",
        action="store_true",
        help="exit 1 when the framework sources exceed the stated budget",
    )
    insp.set_defaults(handler=cmd_inspect)

    tasks = sub.add_parser("tasks", help="list the tasks")
    tasks.set_defaults(handler=cmd_tasks)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as error:
        print(f"ate-bench: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
