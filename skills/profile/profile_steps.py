"""profile: trainer steps (forward, backward, AdamW step) under torch.profiler; prints the top operators
and kernels by self time (device time on CUDA, CPU time on CPU) and writes a chrome trace (open it in
https://ui.perfetto.dev or chrome://tracing); with --csv also the three heaviest kernels as
`kernel_name,total_time_ms,instances,mean_time_ms` (GPU kernels on CUDA; on CPU, which runs no kernels,
the operators by self CPU time). PASS if every step finished with a finite loss and the trace holds
events.

Shape legend: B batch, S sequence.
"""

import argparse
import csv
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # skills/, for _common
import _common  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402


def top_kernels(prof, trace: Path, cuda: bool, n: int = 3) -> list[tuple[str, float, int]]:
    """(name, total ms, instances) of the n heaviest, heaviest first: on CUDA the trace's GPU kernels
    (its `kernel` events, `dur` in microseconds), on CPU the ATen operators by self CPU time."""
    if cuda:
        totals: dict[str, list] = {}
        for event in json.loads(trace.read_text())["traceEvents"]:
            if event.get("cat") == "kernel":
                entry = totals.setdefault(event["name"], [0.0, 0])
                entry[0], entry[1] = entry[0] + event["dur"] / 1000, entry[1] + 1
        rows = [(name, total, count) for name, (total, count) in totals.items()]
    else:
        # ATen operators only: record_function ranges and autograd nodes also carry self time on CPU.
        averages = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        rows = [(e.key, e.self_cpu_time_total / 1000, e.count) for e in averages]
    return sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])[:n]


def write_csv(path: Path, rows: list[tuple[str, float, int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["kernel_name", "total_time_ms", "instances", "mean_time_ms"])
        for name, total, count in rows:
            out.writerow([name, f"{total:.4f}", count, f"{round(total, 4) / count:.6f}"])


def main(argv: list[str] | None) -> tuple[bool, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_model_args(parser, batch=(2, 64))
    _common.add_run_args(parser)
    parser.add_argument("--warmup", type=int, default=1, help="unprofiled steps first (compile, autotune)")
    parser.add_argument("--steps", type=int, default=2, help="profiled steps")
    parser.add_argument("--top", type=int, default=15, help="rows of the table")
    parser.add_argument("--trace", default="profile_trace.json", help="the chrome trace to write")
    parser.add_argument("--csv", help="also write the three heaviest kernels to this CSV file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    device = _common.device_of(args.device)
    model = _common.build_model(args, device)
    ids_BS = _common.token_ids(args, model.cfg.vocab_size, device)
    cfg = _common.train_config(args)
    stages, optimizer = _common.stages_of(model, args), _common.optimizer_of(model, cfg)
    cuda = device.type == "cuda"

    def mark(step: int, phase: str) -> None:  # the phases show up as steps' boundaries in the trace
        if cuda:
            torch.cuda.synchronize(device)

    if args.warmup:
        _common.train_steps(model, stages, optimizer, ids_BS, args.warmup, mark, cfg)
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    with profile(activities=activities) as prof, record_function(f"{args.steps} training steps"):
        loss = _common.train_steps(model, stages, optimizer, ids_BS, args.steps, mark, cfg)
    print(f"{args.model} on {device}: {args.steps} profiled steps, batch {args.micro_batch} x {args.seq_len}")
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top))
    trace = Path(args.trace)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    events = len(json.loads(trace.read_text()).get("traceEvents", []))
    if not math.isfinite(loss):
        return False, f"the loss is {loss}"
    if not events:
        return False, f"{trace} holds no events"
    if args.csv:
        rows = top_kernels(prof, trace, cuda)
        write_csv(Path(args.csv), rows)
        print(
            f"heaviest {'kernels' if cuda else 'CPU operators'}: {', '.join(r[0] for r in rows)}"
            f" -> {args.csv}"
        )
        if len(rows) < 3:
            return False, f"the profile holds {len(rows)} timed kernels, fewer than 3"
    return True, f"{args.steps} steps done (last loss {loss:.4f}); {events} trace events in {trace}"


if __name__ == "__main__":
    _common.verdict(main)
