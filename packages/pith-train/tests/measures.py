"""Run by test_measure.py in ranks (conftest's run_ranks: `python measures.py WORLD RANK TMP ARGS...`): for
each JSON value of ARGS {"name", "argv", "mirror"?}, pith_train.measure.measure of the config of argv,
written to TMP/NAME.RANK.json: in the ranks' real process group, or (mirror) as one process that plays
the heaviest rank with the others mirrored."""

import json
import os
import sys
from pathlib import Path

import torch
from pith_train.config import load_config
from pith_train.measure import measure

torch.set_num_threads(1)
for args in map(json.loads, sys.argv[4:]):
    if args.get("mirror"):
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(key, None)
    r = measure(load_config(None, args["argv"]), steps=1, warmup=1)
    held = {kind: {k: [list(s), str(d), b] for k, (s, d, b) in v.items()} for kind, v in r["held"].items()}
    out = {"held": held, "peak": r["peak"], "static": r["static"], "plan": r["plan"].total}
    Path(sys.argv[3], f"{args['name']}.{r['rank']}.json").write_text(json.dumps(out))
