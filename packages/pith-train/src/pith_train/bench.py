"""`pith-train bench`: the trainer's own step (train_step through its `Stages`) timed on a fixed MoE
workload (pith-train README, Throughput). Each timed step ends with a sync, as the trainer's do;
`step_ms_back_to_back` syncs once after all of them.

Shape legend: B sequences, S sequence length.
"""

import collections
import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pith_models
import pith_ops._common
import torch
from pith_engine.step import train_step
from pith_models import qwen3_moe
from torch.profiler import ProfilerActivity, profile

from pith_train.config import load_config
from pith_train.data import PackedDataset, WindowLoader, windows
from pith_train.metrics import peak_flops
from pith_train.optim import build_optimizer
from pith_train.plan import check
from pith_train.train import (
    apply_fp8,
    flops_per_token,
    parallel_layout,
    pick_device,
    step_settings,
    trainer_stages,
)

WORKLOAD = dataclasses.replace(qwen3_moe.QWEN3_30B_A3B, num_hidden_layers=4)
WORKLOAD_SEQ_LEN, WORKLOAD_BATCH = 4096, 4
# --tiny: the 2-layer test model, a vocabulary the byte tokenizer fits (--data)
TINY, TINY_SEQ_LEN, TINY_BATCH = dataclasses.replace(qwen3_moe.TINY, vocab_size=260), 32, 2
LR = 3e-4  # constant: no schedule in a benchmark
# --document-mask: lognormal document lengths of FineWeb sample-10BT's mean, 680 GPT-2 tokens (sigma assumed)
DOC_MEDIAN, DOC_SIGMA = 330, 1.2


def document_positions(B: int, S: int, rng) -> torch.Tensor:
    """[B, S] positions of B windows packed with documents of DOC_MEDIAN/DOC_SIGMA's lengths."""
    n = np.ceil(rng.lognormal(math.log(DOC_MEDIAN), DOC_SIGMA, B * S)).astype(np.int64)
    return windows(np.zeros(B * S + 1), S, np.arange(B), np.cumsum(n))[2]


def random_steps(V: int, B: int, S: int, micro_batch: int, device, seed: int, docs: bool):
    """Steps of B uniform random-token sequences in micro-batches; docs: with document_positions (labels
    crossing documents kept: the same work)."""
    gen, rng = torch.Generator(device).manual_seed(seed), np.random.default_rng(seed)
    while True:
        ids_BS = torch.randint(V, (B, S + 1), device=device, generator=gen)
        micro = [(x[:, :-1], x[:, 1:]) for x in ids_BS.split(micro_batch)]
        yield [(*m, document_positions(micro_batch, S, rng)) for m in micro] if docs else micro


# Profile components: a kernel goes by QUANT_FRAGMENTS, the trainer's record_function range, its
# launching ops, or its name (under cuda_graph; names of torch 2.11 on an H200).
RANGES = {"optimizer": "optimizer", "lm_head+loss": "lm_head + loss"}
OP_FRAGMENTS = (
    ("FP8 GEMMs", ("_scaled_mm", "_scaled_grouped_mm")),  # --fp8: experts and projections
    ("expert GEMMs", ("grouped_mm", "grouped_gemm")),
    ("router + permutation", ("moe_permute", "moe_unpermute")),
    ("attention", ("scaled_dot_product", "flex_attention")),
)
NAME_FRAGMENTS = (
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("lm_head + loss", ("_ce_rows",)),
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn")),
    ("FP8 GEMMs", ("float_e4m3_t", "e4m3e4m3", "f8f8", "_qqt", "_qqn")),
    ("expert GEMMs", ("grouped", "groupproblemshape")),
    ("router + permutation", ("_histogram", "_slots", "_gather_rows", "_combine", "topk", "softmax", "sort")),
    ("other GEMMs", ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm")),
)
# By kernel name before the ranges: the FP8 quantisation kernels run inside the FP8 GEMM ops.
QUANT_FRAGMENTS = ("_quant_rows", "_cols_kernel", "_group_scale", "_weight_rows", "_weight_scales")
COMPONENTS = (*[c for c, _ in NAME_FRAGMENTS], "FP8 quantisation", "other")


def classify(name: str, ranges: set[str]) -> str:
    low = name.lower()
    if any(f in low for f in QUANT_FRAGMENTS):
        return "FP8 quantisation"
    for marked, component in RANGES.items():
        if marked in ranges:
            return component
    ops = " ".join(ranges).lower()
    return next(
        (c for c, frags in OP_FRAGMENTS if any(f in ops for f in frags)),
        next((c for c, frags in NAME_FRAGMENTS if any(f in low for f in frags)), "other"),
    )


def _ranges_above(event) -> set[str]:
    names = set()
    while event is not None:
        names.add(event.name)
        event = event.cpu_parent
    return names


def _device(events) -> list:
    """Device activity (kernels, copies, fills), not the device-side spans of record_function ranges."""
    cpu = torch.autograd.DeviceType.CPU
    return [e for e in events if e.device_type != cpu and not getattr(e, "is_user_annotation", False)]


def _timed(prof):
    """(component, name, us) of each device activity (on CPU: each op's self time)."""
    events, cpu = prof.events(), torch.autograd.DeviceType.CPU
    device = _device(events)
    if not device:
        return [(classify(e.name, _ranges_above(e)), e.name, e.self_cpu_time_total) for e in events]
    unlinked = collections.Counter((e.name, e.time_range.end - e.time_range.start) for e in device)
    out = []
    for e in events:
        for k in e.kernels if e.device_type == cpu else ():
            if unlinked[(k.name, k.duration)] > 0:  # each device activity is counted once
                unlinked[(k.name, k.duration)] -= 1
                out.append((classify(k.name, _ranges_above(e)), k.name, k.duration))
    return out + [(classify(name, set()), name, us) for (name, us), n in unlinked.items() for _ in range(n)]


def breakdown(prof, steps: int) -> dict[str, float]:
    totals = collections.Counter()
    for component, _, us in _timed(prof):
        totals[component] += us
    return {c: totals[c] / 1e3 / steps for c in COMPONENTS}


def kernels(prof, steps: int, top: int = 60) -> list[dict]:
    us, calls = collections.Counter(), collections.Counter()
    for component, name, t in _timed(prof):
        us[component, name] += t
        calls[component, name] += 1
    return [
        dict(component=c, name=n[:160], calls_per_step=calls[c, n] / steps, ms_per_step=t / 1e3 / steps)
        for (c, n), t in us.most_common(top)
    ]


def idle(prof, steps: int, top: int = 12) -> dict | None:
    """Time with no device activity, by gap length (launch gaps against the CPU falling behind)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in _device(prof.events()))
    if not spans:
        return None
    gaps, (_, end, last) = [], spans[0]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, last, name))
        if stop > end:
            end, last = stop, name
    bins = {"under 10 us": (0, 10), "10-100 us": (10, 100), "over 100 us": (100, math.inf)}
    return {
        "idle_ms_per_step": sum(g for g, _, _ in gaps) / 1e3 / steps,
        "by_length_ms_per_step": {
            k: sum(g for g, _, _ in gaps if lo <= g < hi) / 1e3 / steps for k, (lo, hi) in bins.items()
        },
        "gaps_per_step": len(gaps) / steps,
        "longest": [dict(us=g, after=a[:80], before=b[:80]) for g, a, b in sorted(gaps, reverse=True)[:top]],
    }


PITH_PACKAGES = ("pith_ops/", "pith_engine/", "pith_models/", "pith_train/")
HISTORY_ENTRIES = 4_000_000  # the allocator history's ring buffer (--memory-peak)


def memory_at_peak(snapshot: dict, device: int = 0, top: int = 15) -> dict:
    """The allocator's history replayed to its peak, the blocks live then by their innermost frame in
    pith's packages, and whether the history held it all."""
    trace = snapshot["device_traces"][device]
    events = [e for e in trace if e["action"] in ("alloc", "free_completed")]
    total, peak, at = 0, 0, -1
    for i, e in enumerate(events):
        total += e["size"] if e["action"] == "alloc" else -e["size"]
        if total > peak:
            peak, at = total, i
    live = {}
    for e in events[: at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    sizes, blocks = collections.Counter(), collections.Counter()
    for e in live.values():
        frames = e.get("frames") or [{"filename": "?", "line": 0, "name": "?"}]
        f = next((f for f in frames if any(p in f["filename"] for p in PITH_PACKAGES)), frames[0])
        site = f"{f['filename'].rpartition('/src/')[2] or f['filename']}:{f['line']} {f['name']}"
        sizes[site] += e["size"]
        blocks[site] += 1
    sites = [{"gib": n / 2**30, "blocks": blocks[k], "site": k} for k, n in sizes.most_common(top)]
    return {"peak_gib": peak / 2**30, "sites": sites, "complete": len(trace) < HISTORY_ENTRIES}


def _measured_matmul_flops(device: torch.device) -> float:
    if device.type != "cuda":
        return peak_flops(device)[0]
    a, b = torch.randn(2, 8192, 8192, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times)


def run(
    *, tiny: bool = False, layers: int | None = None, seq_len: int | None = None, batch: int | None = None,
    steps: int = 5, warmup: int = 3, compile: bool = True, ac: str = "none", grouped_gemm: str = "torch",
    fp8: bool = False, fp8_lm_head: bool = False, cuda_graph: bool = False, profile_steps: int = 0,
    data: str | None = None, device: str = "auto", seed: int = 0, dp: int = 1, cp: int = 1, ep: int = 1,
    micro_batch: int | None = None, overlap: bool = True, wgrad_delay: bool = True,
    perturb_seed: int | None = None, back_to_back: bool = True, memory_peak: bool = False,
    document_mask: bool = False,
) -> dict:  # fmt: skip
    """`batch` is global. perturb_seed: each initial weight times 1 + u, u uniform in +-2^-9 (half a
    bf16 ulp), for loss_equivalence.py."""
    if steps < 1 or warmup < 0 or profile_steps < 0:
        raise ValueError(
            f"expected steps >= 1, warmup >= 0, profile_steps >= 0; got {steps}, {warmup}, {profile_steps}"
        )
    if grouped_gemm not in ("torch", "triton"):
        raise ValueError(f"grouped_gemm: expected torch or triton, got {grouped_gemm!r}")
    model_cfg = TINY if tiny else WORKLOAD
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers: expected >= 1, got {layers}")
        model_cfg = dataclasses.replace(model_cfg, num_hidden_layers=layers)
    S = seq_len or (TINY_SEQ_LEN if tiny else WORKLOAD_SEQ_LEN)
    B = batch or (TINY_BATCH if tiny else WORKLOAD_BATCH)
    if dp < 1 or cp < 1 or ep < 1 or B % (dp * ep):
        raise ValueError(f"expected dp, cp, ep >= 1 and batch {B} divisible by dp*ep = {dp * ep}")
    if perturb_seed is not None and dp * cp * ep > 1:
        raise ValueError(f"perturb_seed is for one process, got dp*cp*ep = {dp * cp * ep}")
    Bl = B // (dp * ep)  # sequences of one data rank
    mb = Bl if micro_batch is None else micro_batch
    if mb < 1 or Bl % mb:
        raise ValueError(f"micro_batch: expected a divisor of the {Bl} sequences per data rank, got {mb}")
    cfg = load_config(None, [
        f"data.seq_len={S}", f"train.global_batch={B}", f"train.micro_batch={mb}", f"train.device={device}",
        f"train.compile={compile}", f"train.ac={ac}", f"train.seed={seed}", f"train.fp8={fp8}",
        f"train.fp8_lm_head={fp8_lm_head}", f"train.cuda_graph={cuda_graph}", f"parallel.dp={dp}",
        f"parallel.cp={cp}", f"parallel.ep={ep}", f"parallel.overlap={overlap}",
        f"parallel.wgrad_delay={wgrad_delay}", f"data.document_mask={document_mask}",
    ])  # fmt: skip
    # As TorchTitan: freed blocks coalesce, so the reserved peak stays near the allocated one.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    dev = pick_device(device, "device")
    cuda = dev.type == "cuda"
    if memory_peak and (not cuda or warmup < 1):
        raise ValueError(
            "memory_peak records the CUDA allocator's history over the warm-up steps: run on a CUDA"
            f" device with warmup >= 1 (got {dev.type}, warmup {warmup}), or drop it"
        )
    planned = check(cfg, model_cfg, dev, f"bench --dp {dp} --cp {cp} --ep {ep}")  # before building
    pith_ops._common.USE_TORCH_GROUPED_MM = grouped_gemm == "torch"
    torch.manual_seed(seed)
    mesh = parallel_layout(cfg, dev)
    model = pith_models.build(model_cfg, dev, seed, mesh, torch.bfloat16 if cuda else None)
    if perturb_seed is not None:
        gen = torch.Generator(dev).manual_seed(perturb_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(torch.empty_like(p).uniform_(1 - 2**-9, 1 + 2**-9, generator=gen))
    apply_fp8(cfg, model, cuda)
    optimizer = build_optimizer(model, cfg)
    stages = trainer_stages(cfg, model, mesh)
    settings = step_settings(cfg, model)
    loader = None
    if data is not None:
        ds = PackedDataset(data)
        ds.check_vocab(model_cfg.vocab_size)
        loader = WindowLoader(ds, S, cfg.data.val_windows, seed, docs=document_mask)
    randoms = random_steps(model_cfg.vocab_size, Bl, S, mb, dev, seed + mesh.data_rank, document_mask)
    cursor = 0

    def step() -> torch.Tensor:
        nonlocal cursor
        if loader is None:
            micro = next(randoms)
        else:
            micro = loader.step_batch(cursor, B, mb, mesh.data_rank, mesh.layout.data_ranks)
            cursor += B
        return train_step(stages, optimizer, micro, LR, *settings).loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    graph = cuda_graph and cuda
    if memory_peak:
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
    try:
        for i in range(warmup):
            step()
            if graph and i == 0:  # the graph allocates at its capture (the next step), not at its replays
                sync()
                torch.cuda.reset_peak_memory_stats()
        sync()
        at_peak = memory_at_peak(torch.cuda.memory._snapshot(), dev.index) if memory_peak else None
    finally:
        if memory_peak:
            torch.cuda.memory._record_memory_history(enabled=None)
    if cuda and not graph:
        torch.cuda.reset_peak_memory_stats()
    seconds, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(step())
        sync()
        seconds.append(time.perf_counter() - start)
    step_s = statistics.median(seconds)
    back_to_back_ms = None
    if back_to_back:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        back_to_back_ms = (time.perf_counter() - start) / steps * 1e3
    tokens_per_s = B * S / step_s
    whole = pith_models.build(model_cfg)  # on meta: every expert (this rank holds some)
    f_full, f_none = flops_per_token(whole, S), flops_per_token(whole, 0)
    f_causal = f_none + (f_full - f_none) / 2
    datasheet, datasheet_source = peak_flops(dev)
    measured = _measured_matmul_flops(dev)
    gib = 2**30
    workload = dict(
        model=dataclasses.asdict(model_cfg), params=pith_models.param_count(whole),
        active_params_nonembed=f_none / 6, seq_len=S, batch=B, tokens_per_step=B * S,
        data=data or "random tokens, uniform over the vocabulary")  # fmt: skip
    knobs = dict(
        compile=compile and cuda, ac=ac, grouped_gemm=grouped_gemm, fp8=fp8, fp8_lm_head=fp8_lm_head,
        cuda_graph=cuda_graph and cuda, micro_batches=Bl // mb, overlap=overlap, wgrad_delay=wgrad_delay,
        document_mask=document_mask, steps=steps, warmup=warmup, torch=torch.__version__)  # fmt: skip
    out = {
        "card": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "layout": dict(world=mesh.layout.world, dp=dp, cp=cp, ep=ep, fsdp=mesh.dense_mesh is not None),
        "workload": workload, "settings": knobs, "step_ms": step_s * 1e3,
        "step_ms_all": [s * 1e3 for s in seconds], "step_ms_back_to_back": back_to_back_ms,
        "tokens_per_s": tokens_per_s, "flops_per_token_causal": f_causal, "flops_per_token_full": f_full,
        "model_tflops_causal": f_causal * tokens_per_s / 1e12, "measured_matmul_tflops": measured / 1e12,
        "mfu_measured": f_causal * tokens_per_s / (measured * mesh.layout.world),
        "datasheet_tflops": datasheet / 1e12, "datasheet_source": datasheet_source,
        "mfu_989": f_full * tokens_per_s / (datasheet * mesh.layout.world),
        "peak_allocated_gib": torch.cuda.max_memory_allocated(dev) / gib if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(dev) / gib if cuda else None,
        "plan_gib": {"total": planned.total / gib, **{k: v / gib for k, v in planned.terms.items()}},
        "losses": [float(loss) for loss in losses], "memory_at_peak": at_peak,
    }  # fmt: skip
    if profile_steps:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(profile_steps):
                step()
            sync()
        out["breakdown_ms_per_step"] = breakdown(prof, profile_steps)
        out["kernels"] = kernels(prof, profile_steps)
        out["idle"] = idle(prof, profile_steps)
    return out


# --compare fails below this share of the record: calls on one machine differ by ~1-3%.
COMPARE_FLOOR = 0.97


def record(r: dict, write: bool) -> tuple[bool, str]:
    """-> (r's throughputs >= COMPARE_FLOOR x benchmarks/<card>.json's record of its settings, a report);
    write: r becomes that record."""
    w, b2b = r["workload"], r["step_ms_back_to_back"]
    key = {**r["settings"], "layout": r["layout"], "layers": w["model"]["num_hidden_layers"]}
    key.update(seq_len=w["seq_len"], batch=w["batch"], data=w["data"])
    new = dict(
        card=r["card"], torch=key.pop("torch"), commit=os.environ.get("PITH_COMMIT", "unknown"),
        date=time.strftime("%Y-%m-%d", time.gmtime()), settings=key, step_ms=r["step_ms"],
        tokens_per_s=r["tokens_per_s"], back_to_back=b2b and w["tokens_per_step"] / b2b * 1e3,
        breakdown_ms_per_step=r.get("breakdown_ms_per_step"),
    )  # fmt: skip
    path = Path("benchmarks", "".join(c if c.isalnum() else "-" for c in r["card"].lower()) + ".json")
    records = json.loads(path.read_text()) if path.exists() else []
    old = next((e for e in records if e["settings"] == key), None)
    if write:
        path.write_text(json.dumps([e for e in records if e is not old] + [new], indent=1))
        return True, f"recorded in {path}"
    if old is None:
        return False, f"no record for {r['card']} with these settings in {path} (bench --record makes one)"
    report = f"against {path}'s record of {old['date']} ({old['commit']}, torch {old['torch']}):"
    ratios = {k: new[k] / old[k] for k in ("tokens_per_s", "back_to_back") if new[k] and old[k]}
    for k, x in ratios.items():
        below = f", below {COMPARE_FLOOR}" if x < COMPARE_FLOOR else ""
        report += f"\n  {k} {new[k]:,.0f} against {old[k]:,.0f}: {x:.3f}{below}"
    return min(ratios.values(), default=1) >= COMPARE_FLOOR, report


def summary(r: dict) -> str:
    mem = (
        f"peak memory {r['peak_allocated_gib']:.1f} GiB allocated, {r['peak_reserved_gib']:.1f} GiB reserved"
        f" (pith-train plan: {r['plan_gib']['total']:.1f})"
        if r["peak_allocated_gib"] is not None
        else "peak memory: not tracked on cpu"
    )
    s = r["settings"]
    lines = [
        f"{r['card']}: {r['workload']['tokens_per_step']:,} tokens/step, "
        + " ".join(f"{k}={v}" for k, v in s.items() if k not in ("steps", "warmup", "torch"))
        + f", layout {r['layout']}",
        f"  {r['tokens_per_s']:,.0f} tokens/s, step {r['step_ms']:.1f} ms (median of {s['steps']})",
        f"  MFU {r['mfu_measured']:.1%}: causal FLOPs over the measured"
        f" {r['measured_matmul_tflops']:.3g} TFLOP/s matmul (bf16 on CUDA)"
        f" ({r['model_tflops_causal']:.3g} TFLOP/s achieved);"
        f" {r['mfu_989']:.1%} in the TorchTitan convention over {r['datasheet_tflops']:.3g} TFLOP/s",
        f"  {mem}",
    ]
    if m := r.get("memory_at_peak"):
        lost = "" if m["complete"] else "; the history overflowed, its start is lost: not the run's peak"
        lines.append(
            f"  live at the warm-up's allocation peak ({m['peak_gib']:.2f} GiB beyond the start{lost}):"
        )
        lines += [f"    {x['gib']:7.2f} GiB {x['blocks']:6d} blocks  {x['site'][:100]}" for x in m["sites"]]
    if (ms := r["step_ms_back_to_back"]) is not None:
        tokens = r["workload"]["tokens_per_step"] / ms * 1e3
        lines.insert(
            2, f"  back to back (one sync after {s['steps']} steps): {ms:.1f} ms/step, {tokens:,.0f} tokens/s"
        )
    if "breakdown_ms_per_step" in r:
        parts = r["breakdown_ms_per_step"]
        total = sum(parts.values()) or 1.0
        lines.append(f"  profile breakdown ({total:.1f} ms/step of kernel time):")
        lines += [f"    {c:<22} {ms:8.2f} ms  {ms / total:6.1%}" for c, ms in parts.items()]
        lines.append("  kernels by time (ms/step, launches/step, component, name):")
        lines += [
            f"    {k['ms_per_step']:8.3f} {k['calls_per_step']:6.1f}  {k['component']:<20} {k['name'][:90]}"
            for k in r["kernels"]
        ]
    if i := r.get("idle"):
        by = ", ".join(f"{k} {ms:.2f}" for k, ms in i["by_length_ms_per_step"].items())
        lines.append(
            f"  device idle inside the profiled steps (no sync between them): {i['idle_ms_per_step']:.2f}"
            f" ms/step in {i['gaps_per_step']:.0f} gaps ({by} ms); longest (us, after -> before):"
        )
        lines += [f"    {g['us']:8.0f}  {g['after'][:60]} -> {g['before'][:60]}" for g in i["longest"]]
    return "\n".join(lines)
