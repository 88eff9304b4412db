"""The `pith-train` command (also `python -m pith_train`): a parser per subcommand in `main`, and a
function taking its parsed arguments. Errors a user can fix are one line on stderr and exit 1."""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path


def cmd_prepare_data(args: argparse.Namespace) -> None:
    from pith_train.prepare import find_inputs, padded_vocab, prepare

    tokenizer, vocab = args.tokenizer or "byte", args.train_tokenizer
    keys = ("text_field", "workers", "train_tokenizer") if args.chat else ("max_tokens", "too_long")
    if bad := [f"--{k.replace('_', '-')}" for k in keys if getattr(args, k) is not None]:
        raise ValueError(f"{', '.join(bad)}: {'not used' if args.chat else 'used only'} with --chat; omit")
    files = find_inputs(args.inputs, args.glob)
    if args.chat:
        from pith_train.chat import prepare_chat

        if not args.tokenizer:
            raise ValueError("--chat needs --tokenizer: a Hugging Face tokenizer directory")
        limit = args.max_tokens or 4097
        meta = prepare_chat(files, args.out, tokenizer, limit, args.too_long == "drop")
        print(
            f"{args.out}: {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens"
            f" ({meta['assistant_tokens']:,} the assistant's, which the loss counts); {meta['truncated']:,}"
            f" truncated, {meta['dropped']:,} dropped as longer than {limit:,} tokens"
        )
        return
    meta = prepare(files, args.out, tokenizer, args.text_field or "text", args.workers, train_vocab=vocab)
    print(f"{args.out}: {meta['num_tokens']:,} tokens in {meta['num_docs']:,} documents")
    if vocab:
        train = f"--data.tokenizer={meta['tokenizer']} --model.vocab_size={padded_vocab(meta['vocab_size'])}"
        print(f"train on it with --data.path={args.out} {train}")


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _config_and_overrides(rest: list[str]) -> tuple[str | None, list[str]]:
    config, overrides = None, []  # `--train.steps 10` or `--train.steps=10`
    for item in rest:
        if item.startswith("--"):
            overrides.append(item)
        elif overrides and "=" not in overrides[-1]:
            overrides[-1] += "=" + item
        elif config is None:
            config = item
        else:
            raise ValueError(f"unexpected argument {item!r}; overrides look like --section.key=value")
    return config, overrides


def cmd_pretrain(args: argparse.Namespace) -> None:
    from pith_train.config import load_config, to_toml

    cfg = load_config(*_config_and_overrides(args.rest))
    if args.print_config:
        print(to_toml(cfg), end="")
        return
    from pith_train import stopping
    from pith_train.train import pretrain

    if "RANK" in os.environ and (args.run_dir is None or args.nproc_per_node):
        raise ValueError("under torchrun give every rank the same --run-dir, and no --nproc-per-node")
    run_dir = args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    if args.nproc_per_node is not None:  # the workers check it again under torchrun
        cfg.started("--nproc-per-node", n := args.nproc_per_node)
        sys.exit(stopping.launch_local(n, [*args.rest, "--run-dir", run_dir]))
    try:
        out = pretrain(cfg, run_dir)
    except stopping.Interrupted as e:
        if _rank0():
            hint = stopping.resume_command([*args.rest, "--run-dir", run_dir])
            print(f"pith-train pretrain: {e}\n  resume with: {hint}", file=sys.stderr)
        sys.exit(128 + e.signum)
    if not _rank0():
        return
    done = "already complete" if out["loss"] is None else f"loss {out['loss']:.4f}"
    if out["val_loss"] is not None:
        done += f", validation loss {out['val_loss']:.4f}"
    print(
        f"done: step {out['step']}, {done}\n"
        f"  run directory  {out['run_dir']}\n  metrics        {out['metrics']}\n"
        f"  checkpoints    {out['checkpoints']}\n  plot with      pith-train plot {out['run_dir']}"
    )


def _routing_bias(model, refuse: bool) -> None:
    """No supported HF family holds a selection-only routing bias: drop a nonzero one, or refuse."""
    import torch

    biases = [b for n, b in model.named_buffers() if n.endswith("expert_bias") and bool(b.any())]
    if not biases:
        return
    family = model.cfg.to_hf()["model_type"]
    largest = max(float(b.abs().max()) for b in biases)
    what = f"{len(biases)} MoE layers have a nonzero routing bias (expert_bias, largest |bias| {largest:.3g})"
    if refuse:
        raise ValueError(f"{what} and Hugging Face {family} has nowhere to hold it (--refuse-routing-bias)")
    print(
        f"note: {what}; Hugging Face {family} has no selection-only bias, so the export routes without it"
        " and may pick other experts than the trained model. --refuse-routing-bias stops instead;"
        " --train.bias_rate=0 (the default) trains without it."
    )
    with torch.no_grad():
        for b in biases:
            b.zero_()


def cmd_convert(args: argparse.Namespace) -> None:
    """HF directory <-> Pith checkpoint, written as DST.tmp and renamed; tokenizer.json and the run's
    config.toml go along, for eval and generate."""
    import json

    import pith_models
    import torch
    from pith_engine import checkpoint

    from pith_train.chat import TOKENIZER_FILES
    from pith_train.train import build_model

    src, dst = Path(args.src), Path(args.dst)
    tmp = dst.with_name(dst.name + ".tmp")
    for p in dst, tmp:  # DST.tmp: a user's, or what a killed convert left
        if p.exists():
            raise ValueError(f"{str(p)!r} already exists: move or remove it")
    carried = {
        n: (src / n).read_bytes().decode() for n in (*TOKENIZER_FILES, "config.toml") if (src / n).is_file()
    }
    try:
        if (src / ".metadata").is_file():
            model = build_model(str(src), torch.device("cpu"), seed=0)
            _routing_bias(model, args.refuse_routing_bias)
            dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
            pith_models.save_pretrained(model, tmp, dtype=dtype)
            for name, text in carried.items():
                (tmp / name).write_text(text, encoding="utf-8")
            done = f"Hugging Face directory {dst}"
        elif (src / "config.json").is_file():
            model = pith_models.from_pretrained(src)
            checkpoint.save(
                tmp, model, files={"config.json": json.dumps(model.cfg.to_hf(), indent=1), **carried}
            )
            done = f"Pith checkpoint {dst} (train from it with --model.name={dst})"
        else:
            raise ValueError(
                f"{str(src)!r} is neither a Pith checkpoint (.metadata) nor a Hugging Face directory"
            )
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    note = f"; {src} has no tokenizer.json or config.toml: eval and generate need --tokenizer"
    print(f"wrote {done}" + ("" if carried else note))


def _model(path: Path, args: argparse.Namespace):
    from pith_train.train import build_model, pick_device

    return build_model(str(path), pick_device(args.device, "--device", args.cpu_threads), seed=0).eval()


def cmd_eval(args: argparse.Namespace) -> None:
    import math

    from pith_train.config import model_config
    from pith_train.data import PackedDataset
    from pith_train.inference import dataset_loss, run_config, run_tokenizer

    path, ds = Path(args.checkpoint), PackedDataset(args.data)
    ds.check_tokenizer(run_tokenizer(path, args.tokenizer))
    cfg = run_config(path)
    seq_len = args.seq_len or (cfg and cfg.data.seq_len)
    if not seq_len:
        raise ValueError(f"{path} has no run config (config.toml) giving the window length: pass --seq-len")
    ds.check_vocab(model_config(str(path)).vocab_size)  # before the weights load
    model = _model(path, args)
    docs = bool(cfg and cfg.data.document_mask) if args.document_mask is None else args.document_mask
    loss, tokens = dataset_loss(model, ds, seq_len, args.batch, args.max_windows, docs)
    print(
        f"loss {loss:.4f} perplexity {math.exp(loss):.3f}"
        f" ({tokens:,} tokens of {args.data}, windows of {seq_len})"
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from pith_train.chat import hf_tokenizer
    from pith_train.inference import generate, run_tokenizer

    if args.top_p is None and (args.temperature, args.seed) != (None, None):
        raise ValueError("--temperature and --seed sample: add --top-p")
    temperature = 1.0 if args.temperature is None else args.temperature
    if args.top_p is not None and not 0 < args.top_p <= 1 or not temperature > 0:
        raise ValueError(f"--top-p must be in (0, 1] and --temperature > 0; got {args.top_p}, {temperature}")
    path = Path(args.checkpoint)
    tok = run_tokenizer(path, args.tokenizer)
    text = args.prompt
    if args.chat:  # the template's user turn and generation prompt; the turn's end stops it
        chat = hf_tokenizer(args.tokenizer or path)
        text = chat.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        tok.eos_id = chat.eos_token_id
    prompt = tok.encode_batch([text])[0].tolist()
    if not args.prompt:
        raise ValueError("--prompt is empty")
    model = _model(path, args)
    new = generate(model, prompt, args.max_new_tokens, tok, args.top_p, temperature, args.seed or 0)
    print(("" if args.chat else text) + tok.decode(new))


def cmd_check_layout(args: argparse.Namespace) -> None:
    from pith_train.layoutcheck import check_layout

    if not check_layout(*_config_and_overrides(args.rest), args.nproc, args.steps, args.eps, args.rtol):
        sys.exit(1)


def cmd_bench(args: argparse.Namespace) -> None:
    import json

    from pith_train.bench import record, run, summary

    if Path(args.json).is_dir() or not Path(args.json).parent.is_dir():
        raise ValueError(f"--json {args.json}: not a file in a directory")
    on = {k: getattr(args, k) == "on" for k in ("compile", "overlap", "wgrad_delay")}
    skip = {"command", "rest", "run", "json", "record", "compare", "profile", *on}
    result = run(**{k: v for k, v in vars(args).items() if k not in skip}, **on, profile_steps=args.profile)
    if not _rank0():
        return
    print(summary(result))
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    for write in [False] * args.compare + [True] * args.record:
        ok, report = record(result, write)
        print(report)
        if not ok:
            sys.exit(1)


def cmd_plan(args: argparse.Namespace) -> None:
    import torch

    from pith_train import plan
    from pith_train.config import load_config, model_config, validate

    if args.gpus is not None and any(a.startswith("--parallel.dp") for a in args.rest):
        raise ValueError("--gpus sets parallel.dp: give one of them")
    cfg = load_config(*_config_and_overrides(args.rest))
    p = cfg.parallel
    if args.gpus is not None:  # the data ranks that fill N GPUs
        if args.gpus % (p.pp * p.cp * p.ep):  # changes() then names the GPUs the layout needs
            print(
                f"--gpus {args.gpus} is not a multiple of pp*cp*ep = {p.pp * p.cp * p.ep}: planning dp alone"
            )
            p.pp = p.cp = p.ep = 1
        p.dp = args.gpus // (p.pp * p.cp * p.ep)
        validate(cfg)
    if args.gpu_memory is not None and not 0 < args.gpu_memory < float("inf"):
        raise ValueError(f"--gpu-memory {args.gpu_memory}: expected the GiB of one card, > 0")
    if not args.measure and (args.rank, args.steps) != (None, None):
        raise ValueError("--rank and --steps are for --measure: add it")
    if args.measure:
        from pith_train import measure

        return print(measure.report(measure.measure(cfg, args.rank, args.steps or 2)))
    m, cuda = plan.model_shape(model_config(cfg.model)), cfg.train.device != "cpu"
    plan.valid(cfg, m)
    capacity, what = (args.gpu_memory * plan.GIB, "--gpu-memory") if args.gpu_memory else (None, "")
    if not args.gpu_memory and (not cuda or torch.cuda.is_available()):  # this card, or this machine's RAM
        ranks = 1 if cuda else cfg.world
        capacity, what = plan.device_memory(torch.device("cuda" if cuda else "cpu"), ranks)
    out = plan.plan(cfg, m, cuda, capacity)
    print(plan.report(cfg, m, out, what, [] if out.fits else plan.changes(cfg, m, cuda, capacity)))
    if not out.fits:
        sys.exit(1)


def cmd_plot(args: argparse.Namespace) -> None:
    from pith_train.metrics import plot

    print(f"wrote {plot(args.run_dir, args.out)}")


def cmd_schedule(args: argparse.Namespace) -> None:
    from pith_engine.schedule import P2P, Overlap, check, schedule

    def show(item) -> str:
        if isinstance(item, P2P):
            return f"{'>' if item.send else '<'}r{item.peer}:{item.op.value}{item.chunk}.{item.micro}"
        if isinstance(item, Overlap):
            return "[" + "+".join(show(a) for a in item) + "]"
        return f"{item.op.value}{item.chunk}.{item.micro}"

    check(args.pp, args.micro_batches, more="raise --micro-batches")
    lists = [schedule(args.pp, rank, args.micro_batches) for rank in range(args.pp)]
    print("op chunk.micro; [F+B] one overlapped action; >rN / <rN: send to / receive from rank N")
    for rank, lst in enumerate(lists):
        print(f"rank {rank}: " + " ".join(show(a) for a in lst))
    if args.png:
        from pith_train.metrics import plot_schedule

        print(f"wrote {plot_schedule(args.pp, args.micro_batches, args.png)}")


# Each number option's least value, whichever command has it
LEAST = dict.fromkeys(["cpu_threads", "max_windows", "warmup", "profile", "rtol"], 0)
LEAST |= dict.fromkeys(
    ["batch", "seq_len", "steps", "nproc", "pp", "micro_batches", "max_new_tokens", "gpus", "layers"]
    + ["workers", "nproc_per_node", "dp", "cp", "ep", "micro_batch", "max_tokens"],
    1,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pith-train", description="Pith: train Mixture-of-Experts models")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-data", help="tokenize text, JSONL or Parquet files into a packed dataset")
    p.add_argument("inputs", nargs="+", help="files, or directories searched for .txt, .json(l), .parquet")
    p.add_argument("--glob", help="the files to take from directories instead, e.g. '*.py'")
    p.add_argument("--out", required=True, help="dataset directory to create")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", help="'byte' (the default) or a Hugging Face tokenizer.json")
    which.add_argument("--train-tokenizer", type=int, metavar="VOCAB", help="train a BPE instead")
    p.add_argument("--text-field", help="the JSONL field or Parquet column holding the text (default: text)")
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: one per CPU)")
    p.add_argument("--chat", action="store_true", help='.jsonl {"messages": [...]} in the chat template')
    p.add_argument("--max-tokens", type=int, help="with --chat: the longest kept (seq_len + 1; default 4097)")
    p.add_argument("--too-long", choices=["truncate", "drop"], help="with --chat (default: truncate)")
    p.set_defaults(run=cmd_prepare_data)

    p = sub.add_parser(
        "pretrain",
        help="train a model (defaults: tiny-moe on a built-in corpus)",
        usage="pith-train pretrain [CONFIG.toml] [--section.key=value ...] [--run-dir DIR]"
        " [--nproc-per-node N] [--print-config]",
    )
    p.add_argument("--run-dir", help="where config, metrics and checkpoints go (default runs/TIMESTAMP)")
    p.add_argument("--nproc-per-node", type=int, metavar="N", help="N processes here, as torchrun's")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(run=cmd_pretrain)

    p = sub.add_parser(
        "check-layout",
        help="train a few steps in one process and under a parallel layout (torchrun), compare the losses",
        usage="pith-train check-layout [CONFIG.toml] [--section.key=value ...] --nproc N [--steps 4]",
    )
    p.add_argument("--nproc", type=int, required=True, help="processes (= pp*dp*cp*ep of the layout)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps to compare")
    p.add_argument("--eps", type=float, default=1e-3, help="Adam eps of both runs (see the README)")
    p.add_argument("--rtol", type=float, default=1e-5, help="largest relative loss difference that agrees")
    p.set_defaults(run=cmd_check_layout)

    for name, what in (("eval", "loss and perplexity on a dataset"), ("generate", "text from a prompt")):
        p = sub.add_parser(name, help=f"{what} with a checkpoint's weights (or a Hugging Face directory)")
        p.add_argument("checkpoint", help="RUN/checkpoints/step_N, a converted checkpoint or an HF directory")
        p.add_argument("--tokenizer", help="default: the checkpoint's tokenizer.json, or its run's")
        p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        # As train.cpu_threads
        p.add_argument("--cpu-threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    eval_p, gen_p = sub.choices["eval"], sub.choices["generate"]
    eval_p.add_argument("--data", required=True, help="a prepare-data dataset")
    eval_p.add_argument("--seq-len", type=int, help="window length (default: the run config's data.seq_len)")
    eval_p.add_argument("--batch", type=int, default=8, help="windows per forward")
    eval_p.add_argument("--max-windows", type=int, default=0, help="score only the first N windows (0: all)")
    eval_p.add_argument("--document-mask", action=argparse.BooleanOptionalAction, help="default: the run's")
    eval_p.set_defaults(run=cmd_eval)
    gen_p.add_argument("--prompt", required=True)
    gen_p.add_argument("--max-new-tokens", type=int, default=64)
    gen_p.add_argument("--top-p", type=float, help="sample from the top-p nucleus (default: greedy)")
    gen_p.add_argument("--temperature", type=float, help="with --top-p (default 1)")
    gen_p.add_argument("--seed", type=int, help="with --top-p (default 0)")
    gen_p.add_argument("--chat", action="store_true", help="--prompt as a user turn of the chat template")
    gen_p.set_defaults(run=cmd_generate)

    p = sub.add_parser("convert", help="Hugging Face directory <-> Pith checkpoint")
    p.add_argument("src", help="a Hugging Face directory or a Pith checkpoint (checkpoints/step_N)")
    p.add_argument("dst", help="the directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="for HF output")
    p.add_argument("--refuse-routing-bias", action="store_true", help="stop on a nonzero routing bias")
    p.set_defaults(run=cmd_convert)

    p = sub.add_parser("bench", help="training throughput on the reference MoE workload (bench.py)")
    p.add_argument("--tiny", action="store_true", help="a CI-sized model and batch instead (runs on CPU)")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--compile", choices=["on", "off"], default="on", help="torch.compile (CUDA only)")
    p.add_argument("--ac", choices=["none", "selective", "full"], default="none", help="recompute policy")
    p.add_argument("--grouped-gemm", choices=["torch", "triton"], default="torch", help="expert GEMM kernel")
    p.add_argument("--fp8", action="store_true", help="projections and expert GEMMs in FP8 (train.fp8)")
    p.add_argument("--fp8-lm-head", action="store_true", help="lm_head's GEMMs in FP8 (train.fp8_lm_head)")
    p.add_argument("--cuda-graph", action="store_true", help="the step as a CUDA graph (train.cuda_graph)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS", help="profile STEPS more steps")
    p.add_argument("--memory-peak", action="store_true", help="what is live at the warm-up's memory peak")
    p.add_argument("--layers", type=int, help="decoder layers (default 4)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, help="sequences per optimizer step (default 4)")
    p.add_argument("--data", help="a prepare-data dataset (default: random tokens)")
    p.add_argument("--document-mask", action="store_true", help="data.document_mask (bench.DOC_MEDIAN)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    for axis in ("dp", "cp", "ep"):  # under torchrun: world = dp*cp*ep
        p.add_argument(f"--{axis}", type=int, default=1, help=f"parallel.{axis} (torchrun)")
    p.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default: the whole batch)")
    for flag in ("overlap", "wgrad-delay"):
        key = flag.replace("-", "_")
        p.add_argument(f"--{flag}", choices=["on", "off"], default="on", help=f"parallel.{key}")
    p.add_argument("--json", default="bench.json", help="where the measurements go")
    p.add_argument("--record", action="store_true", help="set the card's record (benchmarks/README.md)")
    p.add_argument("--compare", action="store_true", help="exit 1 below 0.97 of the card's record")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser(
        "plan",
        help="memory per rank of a run, term by term, and whether it fits the card (plan.py)",
        usage="pith-train plan [CONFIG.toml] [--section.key=value ...] [--gpus N] [--gpu-memory GiB]"
        " [--measure [--rank R] [--steps N]]",
    )
    p.add_argument("--gpus", type=int, help="plan on N GPUs: parallel.dp = N / (pp*cp*ep)")
    p.add_argument("--gpu-memory", type=float, help="GiB per card (default: this machine's card, if any)")
    p.add_argument("--measure", action="store_true", help="play a rank on this device, the others mirrored")
    p.add_argument("--rank", type=int, help="the rank --measure plays (default: the plan's heaviest)")
    p.add_argument("--steps", type=int, help="steps --measure times, after one of warm-up (default 2)")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("plot", help="PNG of loss and throughput against step")
    p.add_argument("run_dir")
    p.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    p.set_defaults(run=cmd_plot)

    p = sub.add_parser("schedule", help="print (and draw) the pipeline schedule of one step")
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--micro-batches", type=int, required=True, help="micro-batches per step (>= 2*pp)")
    p.add_argument("--png", help="also draw the simulated timeline to this PNG")
    p.set_defaults(run=cmd_schedule)

    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command not in ("pretrain", "check-layout", "plan"):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.rest = unknown  # pretrain, check-layout, plan: the config file and the overrides
    dist = sys.modules.get("torch.distributed")
    ours = not (dist and dist.is_initialized())  # a group the command starts, it ends
    try:
        for key, least in LEAST.items():
            if (value := getattr(args, key, None)) is not None and not value >= least:
                raise ValueError(f"--{key.replace('_', '-')} must be >= {least}, got {value}")
        args.run(args)
    except (ValueError, FloatingPointError, OSError) as e:  # bad input, a diverged run, a full disk
        if _rank0():  # the ranks check alike
            print(f"pith-train {args.command}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C, or a stop of check-layout's pretrain
        print(f"pith-train {args.command}: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:  # not left to the exit, where gloo can abort a finished rank
        if ours and (dist := sys.modules.get("torch.distributed")) and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
