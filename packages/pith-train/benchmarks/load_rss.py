"""Peak host memory of pith_models.from_pretrained per rank, on CPU: a Hugging Face directory of a real
geometry cut to a few layers, loaded by one process and by N gloo processes (a layout of N ranks).

    uv run python packages/pith-train/benchmarks/load_rss.py [--model qwen3-30b-a3b] [--layers 2]
        [--layout dp=4] [--dir /tmp/load_rss]

Writes the directory once (bf16, one safetensors shard per layer plus one for the rest, with an index,
as released checkpoints are; random weights), then for each of (one process, the layout) starts fresh
processes, each reporting its peak RSS (VmHWM, reset after torch's import and the process group's
start; file-backed mmap pages included), the RSS before the load, the fp32 bytes of its shard, and
the largest HF tensor of the directory in fp32 ("one tensor"). The bound the load aims for:
peak - before <= shard + one tensor.
"""

import argparse
import dataclasses
import json
import multiprocessing
import os
import socket
import sys
from pathlib import Path


def write(cfg, path: Path) -> None:
    import torch
    from pith_models import hf
    from safetensors.torch import save_file

    shapes = hf.module_of(cfg).to_hf_state_dict(hf.build_empty(cfg).state_dict(), cfg)
    groups: dict[str, dict] = {}
    for k, t in shapes.items():
        layer = k.split(".")[2] if k.startswith("model.layers.") else "rest"
        groups.setdefault(layer, {})[k] = tuple(t.shape)
    path.mkdir(parents=True)
    weight_map = {}
    gen = torch.Generator().manual_seed(0)
    for i, (group, tensors) in enumerate(groups.items()):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        sd = {k: (0.02 * torch.randn(s, generator=gen)).bfloat16() for k, s in tensors.items()}
        save_file(sd, path / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        del sd
        print(f"wrote {name} ({group})", file=sys.stderr)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({**cfg.to_hf(), "torch_dtype": "bfloat16"}))


def hwm() -> int:
    """This process's peak resident bytes since the last reset (file-backed mmap pages included)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def rank_main(path: str, layout: dict, env: dict, out) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist
    from pith_engine.parallel import Layout, build_mesh, local_rows
    from pith_models import from_pretrained

    torch.set_num_threads(1)
    mesh = build_mesh(Layout(**layout), torch.device("cpu")) if layout else None
    # A spawned process inherits its parent's high-water mark (ru_maxrss): reset it (Linux), read VmHWM.
    Path("/proc/self/clear_refs").write_text("5")
    before = hwm()
    model = from_pretrained(path, "cpu", mesh)
    peak = hwm()
    shard = sum(local_rows(p)[0].numel() * 4 for p in model.parameters())
    out.put((int(env.get("RANK", 0)), before, peak, shard))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def measure(path: Path, layout: dict) -> list:
    world = 1
    for v in layout.values():
        world *= v
    ctx = multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, procs = ctx.Queue(), []
    for rank in range(world):
        env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
        env = {k: str(v) for k, v in env.items()} | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(ctx.Process(target=rank_main, args=(str(path), layout, env if world > 1 else {}, out)))
        procs[-1].start()
    rows = sorted(out.get() for _ in procs)
    for p in procs:
        p.join()
    return rows


def main() -> None:
    import pith_models

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--layout", default="dp=4", help="comma-separated axis=size, e.g. dp=2,ep=2")
    p.add_argument("--dir", default="/tmp/load_rss")
    args = p.parse_args()
    cfg = dataclasses.replace(pith_models.MODELS[args.model], num_hidden_layers=args.layers)
    path = Path(args.dir) / f"{args.model}-{args.layers}layers"
    if not path.exists():
        write(cfg, path)
    from pith_models.hf import read_safetensors

    one = max(t.numel() for t in read_safetensors(path).values()) * 4
    total = sum(t.numel() for t in read_safetensors(path).values()) * 4
    layout = {k: int(v) for k, v in (item.split("=") for item in args.layout.split(","))}
    gib = 2**30
    print(f"{args.model}, {args.layers} layers: {total / gib:.2f} GiB fp32, largest {one / gib:.2f} GiB")
    for name, lay in (("one process", {}), (args.layout, layout)):
        for rank, before, peak, shard in measure(path, lay):
            print(
                f"{name:12s} rank {rank}: peak RSS {peak / gib:.2f} GiB, before the load {before / gib:.2f},"
                f" growth {(peak - before) / gib:.2f}; shard {shard / gib:.2f} + one tensor {one / gib:.2f}"
                f" = {(shard + one) / gib:.2f} GiB"
            )


if __name__ == "__main__":
    main()
