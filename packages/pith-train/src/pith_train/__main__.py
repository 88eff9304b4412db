"""`python -m pith_train`: the same command as `pith-train`."""

from pith_train.cli import main

main()
