"""Run under torchrun by the tests: `pith-train pretrain ARGS` for each JSON list ARGS given, one after
another in one process group. Starting the processes (torch's import) costs more than training the
micro model, so layouts of one world size share one start."""

import json
import sys

from pith_train.cli import main

for args in sys.argv[1:]:
    main(["pretrain", *json.loads(args)])
