"""Run by the tests in ranks (conftest's run_ranks: `python pretrains.py WORLD RANK TMP ARGS...` under
torchrun's environment variables): `pith-train pretrain ARGS` for each JSON list ARGS given, one after
another in one process group. Starting the processes costs more than training the micro model, so
layouts of one world size share one start."""

import json
import sys

import torch
from pith_train.cli import main

torch.set_num_threads(1)
for args in sys.argv[4:]:
    main(["pretrain", *json.loads(args)])
