"""`python -m pith_models [NAME ...]`: build each named model on the meta device (no memory) and
print its parameter count; all of MODELS without names."""

import sys

import pith_models

for name in sys.argv[1:] or pith_models.MODELS:
    print(f"{name:<20} {pith_models.param_count(pith_models.build(name)):>16,} parameters")
