"""Run by the tests in ranks (conftest's run_ranks: `python pretrains.py WORLD RANK TMP ARGS...` under
torchrun's environment variables): for each JSON value of ARGS, one after another in one process group,
a list: `pith-train pretrain ARGS`; an object {"run_dir", "argv", "stop_at"?, "count"?}: pretrain(config
of argv, run_dir, stop_at), with count: this rank's calls of Attention modules written to
RUN_DIR/attention_calls.RANK (test_config_space). Starting the processes costs more than training the
micro model, so layouts of one world size share one start."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from pith_train.cli import main
from pith_train.config import load_config
from pith_train.train import pretrain

torch.set_num_threads(1)
dist.init_process_group("gloo")  # one group for every run: `pith-train pretrain` leaves it
for args in map(json.loads, sys.argv[4:]):
    if isinstance(args, list):
        main(["pretrain", *args])
        continue
    calls = []
    count = lambda module, inputs, output, calls=calls: calls.append(type(module).__name__ == "Attention")
    handle = torch.nn.modules.module.register_module_forward_hook(count) if args.get("count") else None
    pretrain(load_config(None, args["argv"]), args["run_dir"], args.get("stop_at"))
    if handle is not None:
        handle.remove()
        Path(args["run_dir"], f"attention_calls.{sys.argv[2]}").write_text(str(sum(calls)))
