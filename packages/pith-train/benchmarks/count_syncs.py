"""Host syncs in one `train_step` on CUDA, by source line (torch.cuda.set_sync_debug_mode flags every
synchronizing call: .item(), .tolist(), pageable copies, data-dependent output sizes):

    python3 packages/pith-train/benchmarks/count_syncs.py

The bench workload's width at 2 layers, 2 x 1024 random tokens, eager (compiled graphs would hide
nothing here: the syncs come from eager code), one warm-up step, then one counted step.
"""

import collections
import dataclasses
import warnings

import pith_models
import torch
from pith_train.bench import WORKLOAD
from pith_train.config import load_config
from pith_train.optim import build_optimizer
from pith_train.train import Stages, expert_biases, parallel_layout, train_step


def main() -> None:
    dev = torch.device("cuda")
    cfg = load_config(None, ["data.seq_len=1024", "train.global_batch=2", "train.micro_batch=2"])
    model = pith_models.build(dataclasses.replace(WORKLOAD, num_hidden_layers=2), dev, 0)
    optimizer, stages = build_optimizer(model, cfg), Stages(model, False, "none", torch.bfloat16)
    biases = expert_biases(model)
    layout = parallel_layout(cfg, dev)
    ids_BS = torch.randint(WORKLOAD.vocab_size, (2, 1025), device=dev)
    step = lambda: train_step(
        model, stages, optimizer, [(ids_BS[:, :-1], ids_BS[:, 1:])], cfg, layout, 1e-4, biases
    )  # noqa: E731
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        step()
        torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(
        f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    print(f"{torch.cuda.get_device_name()}: {sum(sites.values())} host syncs in one train_step")
    for site, n in sites.most_common():
        print(f"  {n:3d}  {site}")


if __name__ == "__main__":
    main()
