"""memory-prints: a few trainer steps (forward, backward, AdamW step) with the memory after each phase:
on CUDA torch.cuda's allocated, reserved and the phase's peak; on CPU (no device statistics) the bytes
of parameters, gradients and optimizer state, and the process's peak resident memory. PASS if the
peak (CUDA: peak reserved, what the device had to supply; CPU: peak resident) is within --gib.

Shape legend: B batch, S sequence.
"""

import argparse
import math
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # skills/, for _common
import _common  # noqa: E402
import torch  # noqa: E402

G = _common.GIB


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def main(argv: list[str] | None) -> tuple[bool, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_model_args(parser, batch=(2, 64))
    _common.add_run_args(parser)
    parser.add_argument("--steps", type=int, default=3, help="the first also creates the AdamW state")
    parser.add_argument("--gib", type=float, required=True, help="memory budget, GiB")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    device = _common.device_of(args.device)
    model = _common.build_model(args, device)
    ids_BS = _common.token_ids(args, model.cfg.vocab_size, device)
    cfg = _common.train_config(args)
    stages, optimizer = _common.stages_of(model, args), _common.optimizer_of(model, cfg)
    n = _common.pith_models.param_count(model)
    print(
        f"{args.model} on {device}: {n:,} parameters, batch {args.micro_batch} x {args.seq_len}, ac {args.ac}"
    )
    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated(device) if cuda else 0
    peak = 0.0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        print(f"  before the first step: allocated {base / G:.3f} GiB (the fp32 weights)")
        print(f"  {'step':>4} {'phase':<10} {'allocated':>10} {'reserved':>10} {'phase peak':>11}  (GiB)")
    else:
        print(
            "  device memory statistics are unavailable on CPU: tensor bytes and peak resident memory instead"
        )
        print(f"  parameters {tensor_bytes(model.parameters()) / G:.4f} GiB")

    def mark(step: int, phase: str) -> None:
        nonlocal peak
        if not cuda:
            if phase != "forward":  # the AdamW step frees the gradients (set_to_none)
                grads = phase == "backward"
                held = [p.grad for p in model.parameters()] if grads else optimizer.state.values()
                held = held if grads else [t for state in held for t in state.values()]
                print(f"  step {step} after {phase:<9}: {'gradients' if grads else 'AdamW state'}"
                      f" {tensor_bytes(held) / G:.4f} GiB")  # fmt: skip
            return
        torch.cuda.synchronize(device)
        alloc, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        peak = max(peak, torch.cuda.max_memory_reserved(device) / G)
        print(f"  {step:>4} {phase:<10} {alloc / G:10.3f} {reserved / G:10.3f} "
              f"{torch.cuda.max_memory_allocated(device) / G:11.3f}")  # fmt: skip
        if phase == "forward":  # kept for the backward: compare with estimate-memory's activations
            print(f"       held by the forward (activations, bf16 weight casts): {(alloc - base) / G:.3f}")
        torch.cuda.reset_peak_memory_stats(device)

    loss = _common.train_steps(model, stages, optimizer, ids_BS, args.steps, mark, cfg)
    what = "peak reserved"
    if not cuda:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / G  # Linux reports KiB
        print(f"  peak resident memory of this process: {peak:.3f} GiB")
        what = "peak resident"
    if not math.isfinite(loss):
        return False, f"the loss is {loss}"
    ok = peak <= args.gib
    return ok, f"{what} {peak:.3f} GiB {'<=' if ok else '>'} budget {args.gib:g} GiB (last loss {loss:.4f})"


if __name__ == "__main__":
    _common.verdict(main)
