"""The `pith-train` command (also `python -m pith_train`): prepare-data, pretrain, convert, bench, plot.

Each subcommand is a parser built in `main` plus one function taking the parsed arguments; a new
subcommand adds both.
"""

import argparse
import sys
import time
from pathlib import Path


def cmd_prepare_data(args: argparse.Namespace) -> None:
    from pith_train.prepare import find_inputs, prepare

    meta = prepare(find_inputs(args.inputs), args.out, args.tokenizer, args.text_field, args.workers)
    print(f"wrote {args.out}: {meta['num_tokens']:,} tokens in {meta['num_docs']:,} documents")


def cmd_pretrain(args: argparse.Namespace) -> None:
    from pith_train.config import load_config, to_toml

    config, overrides = None, []  # `--train.steps 10` is accepted as well as `--train.steps=10`
    for item in args.rest:
        if item.startswith("--"):
            overrides.append(item)
        elif overrides and "=" not in overrides[-1]:
            overrides[-1] += "=" + item
        elif config is None:
            config = item
        else:
            raise ValueError(f"unexpected argument {item!r}; overrides look like --section.key=value")
    cfg = load_config(config, overrides)
    if args.print_config:
        print(to_toml(cfg), end="")
        return
    from pith_train.train import pretrain

    run_dir = args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    out = pretrain(cfg, run_dir)
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:  # under torchrun rank 0 reports
        return
    done = "already complete" if out["loss"] is None else f"loss {out['loss']:.4f}"
    if out["val_loss"] is not None:
        done += f", validation loss {out['val_loss']:.4f}"
    print(
        f"done: step {out['step']}, {done}\n"
        f"  run directory  {out['run_dir']}\n  metrics        {out['metrics']}\n"
        f"  checkpoints    {out['checkpoints']}\n  plot with      pith-train plot {out['run_dir']}"
    )


def cmd_convert(args: argparse.Namespace) -> None:
    """HF directory -> Pith checkpoint, or Pith checkpoint -> HF directory (told apart by their files)."""
    import json

    import pith_models
    import torch
    from pith_engine import checkpoint
    from pith_models.hf import config_from_hf

    src = Path(args.src)
    if Path(args.dst).exists():
        raise ValueError(f"destination {args.dst!r} already exists")
    if (src / ".metadata").is_file():
        model = pith_models.build(config_from_hf(json.loads((src / "config.json").read_text())), "cpu")
        checkpoint.load(src, model)
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
        pith_models.save_pretrained(model, args.dst, dtype=dtype)
        print(f"wrote Hugging Face directory {args.dst}")
    elif (src / "config.json").is_file():
        model = pith_models.from_pretrained(src)
        config = json.dumps(model.cfg.to_hf(), indent=1)
        checkpoint.save(Path(args.dst), model, files={"config.json": config})
        print(f"wrote Pith checkpoint {args.dst} (train from it with --model.name={args.dst})")
    else:
        raise ValueError(
            f"{str(src)!r} is neither a Pith checkpoint (.metadata) nor a Hugging Face directory"
        )


def cmd_bench(args: argparse.Namespace) -> None:
    import json

    from pith_train.bench import run, summary

    result = run(
        tiny=args.tiny, layers=args.layers, seq_len=args.seq_len, batch=args.batch, steps=args.steps,
        warmup=args.warmup, compile=args.compile == "on", ac=args.ac, grouped_gemm=args.grouped_gemm,
        profile_steps=args.profile, data=args.data, device=args.device,
    )  # fmt: skip
    print(summary(result))
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


def cmd_plot(args: argparse.Namespace) -> None:
    from pith_train.metrics import plot

    print(f"wrote {plot(args.run_dir, args.out)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pith-train", description="Pith: train Mixture-of-Experts models")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-data", help="tokenize .txt/.jsonl files into a packed dataset")
    p.add_argument("inputs", nargs="+", help="files, or directories searched for .txt and .jsonl files")
    p.add_argument("--out", required=True, help="dataset directory to create")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizer.json")
    p.add_argument("--text-field", default="text", help="the JSON field holding a .jsonl line's text")
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: one per CPU)")
    p.set_defaults(run=cmd_prepare_data)

    p = sub.add_parser(
        "pretrain",
        help="train a model (defaults: tiny-moe on a built-in corpus)",
        usage="pith-train pretrain [CONFIG.toml] [--section.key=value ...] [--run-dir DIR] [--print-config]",
    )
    p.add_argument("--run-dir", help="where config, metrics and checkpoints go (default runs/TIMESTAMP)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(run=cmd_pretrain)

    p = sub.add_parser("convert", help="Hugging Face directory <-> Pith checkpoint")
    p.add_argument("src", help="a Hugging Face directory or a Pith checkpoint (checkpoints/step_N)")
    p.add_argument("dst", help="the directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="for HF output")
    p.set_defaults(run=cmd_convert)

    p = sub.add_parser("bench", help="training throughput on the reference MoE workload (bench.py)")
    p.add_argument("--tiny", action="store_true", help="a CI-sized model and batch instead (runs on CPU)")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--compile", choices=["on", "off"], default="on", help="torch.compile (CUDA only)")
    p.add_argument("--ac", choices=["none", "selective", "full"], default="none", help="recompute policy")
    p.add_argument("--grouped-gemm", choices=["torch", "triton"], default="torch", help="expert GEMM kernel")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS", help="profile STEPS more steps")
    p.add_argument("--layers", type=int, help="decoder layers (default 4)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, help="sequences per optimizer step (default 4)")
    p.add_argument("--data", help="a prepare-data dataset (default: random tokens)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--json", default="bench.json", help="where the measurements go")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("plot", help="PNG of loss and throughput against step")
    p.add_argument("run_dir")
    p.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    p.set_defaults(run=cmd_plot)

    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "pretrain":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.rest = unknown  # pretrain: the config file and the overrides
    try:
        args.run(args)
    except (ValueError, FloatingPointError) as e:  # bad input, or a diverged run: the message says what
        print(f"pith-train {args.command}: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
