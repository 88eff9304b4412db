"""op-03's reference procedure on Pith, run by `ate-bench run --agent scripted` in an attempt's
worktree: a short training run of the trainer's own step (pith_train.train.train_step) on the
staged dataset that, at each traced step, runs the step's first micro-batch through the stages
once more without gradients and saves the router decisions of its first TOKENS tokens.

    uv run python routing_trace.py --data DATASET --out DIR [--steps N] [--trace-every K]
        [section.key=value ...]

Shape legend: L MoE layers, T tokens, K experts per token, E experts.
"""

import argparse
from pathlib import Path

import numpy as np
import torch
from pith_engine import executor
from pith_train.config import load_config
from pith_train.data import PackedDataset, WindowLoader
from pith_train.optim import build_optimizer, lr_at
from pith_train.train import Stages, build_model, parallel_layout, step_values, train_step

TOKENS = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a `pith-train prepare-data` dataset")
    parser.add_argument("--out", required=True, help="where step-XXXXXXXX.npz files go")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--trace-every", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="trainer config overrides, section.key=value")
    args = parser.parse_args()
    cfg = load_config(None, [f"data.path={args.data}", f"train.steps={args.steps}", *args.overrides])
    if cfg.train.micro_batch * cfg.data.seq_len < TOKENS:
        raise ValueError(
            f"a micro-batch holds {cfg.train.micro_batch * cfg.data.seq_len} tokens, fewer than {TOKENS}"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and cfg.train.cpu_threads:  # as the trainer does
        torch.set_num_threads(cfg.train.cpu_threads)
    layout = parallel_layout(cfg, device)
    loader = WindowLoader(PackedDataset(args.data), cfg.data.seq_len, cfg.data.val_windows, cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model.name, device, cfg.train.seed).float()
    cuda = device.type == "cuda"
    stages = Stages(model, False, cfg.train.ac, torch.bfloat16 if cuda else None)
    optimizer = build_optimizer(model, cfg)
    biases = [
        b for layer in model.layers.values() for n, b in layer.named_buffers() if n.endswith("expert_bias")
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for step in range(1, cfg.train.steps + 1):
        cursor = (step - 1) * cfg.train.global_batch
        micro = loader.step_batch(cursor, cfg.train.global_batch, cfg.train.micro_batch)
        if step == 1 or step % args.trace_every == 0:
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=cuda):
                _, routings = executor.forward(stages, micro[0][0].to(device), executor.LocalExperts())
            ids_LTK = torch.stack([r.expert_ids_TK[:TOKENS] for r in routings]).cpu()
            w_LTK = torch.stack([r.weights_TK[:TOKENS].float() for r in routings]).cpu()
            w_LTK = w_LTK / w_LTK.sum(-1, keepdim=True)  # the task asks for k weights summing to 1
            experts = np.int64(routings[0].probs_TE.shape[1])
            ids = ids_LTK.numpy().astype(np.int64)
            np.savez(
                out / f"step-{step:08d}.npz", expert_ids=ids, gate_weights=w_LTK.numpy(), num_experts=experts
            )
            print(f"step {step}: traced {len(routings)} MoE layers x {TOKENS} tokens -> {out}")
        outputs = train_step(model, stages, optimizer, micro, cfg, layout, lr_at(step - 1, cfg), biases)
        loss = step_values(*outputs)[0]
        print(f"step {step} loss {loss:.4f}")


if __name__ == "__main__":
    main()
