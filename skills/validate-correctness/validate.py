"""validate-correctness: the staged forward of a model equals its reference_forward in fp32, every
parameter gets a finite gradient equal to the reference's, and (when transformers knows the model)
the logits equal transformers' for the same weights. Ends with PASS or FAIL and the numbers.

Shape legend: B batch, S sequence.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # skills/, for _common
import _common  # noqa: E402


def main(argv: list[str] | None) -> tuple[bool, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_model_args(parser, batch=(2, 16))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="fp32 either way")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    args = parser.parse_args(argv)
    device = _common.device_of(args.device)
    model = _common.build_model(args, device)
    loaded = _common.loads_weights(args)
    if not loaded:
        _common.perturb(model, args.seed + 1)
    ids_BS = _common.token_ids(args, model.cfg.vocab_size, device)
    print(
        f"{args.model}: {type(model.cfg).__module__}, {_common.pith_models.param_count(model):,} parameters,"
        f" batch {args.micro_batch} x {args.seq_len} on {device}, {'loaded' if loaded else 'random'} weights"
    )
    hf_dir = Path(args.model) if loaded else None
    failures = _common.correctness(model, ids_BS, hf=not args.no_hf, hf_dir=hf_dir)
    return not failures, "; ".join(failures) or "staged == reference, gradients finite and equal"


if __name__ == "__main__":
    _common.verdict(main)
