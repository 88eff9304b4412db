"""`pith-train plan`: a rank's memory at its peak (the start of the backward or the optimizer step),
from the config and the meta model; `check` refuses a run that cannot fit before anything is built.
Each formula names the code it follows.

Shape legend: T tokens per micro-batch on one rank, D hidden, E experts, K top-k, F expert width,
V vocabulary, L layers, b bytes of the compute dtype (bf16 on CUDA, fp32 on CPU).
"""

import copy
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import pith_models
import torch
from pith_engine import schedule
from pith_engine.parallel import Layout, check_layout, held_layers, num_experts
from torch import nn

from pith_train.config import AC, Config, validate
from pith_train.muon import hidden_matrices

GIB = 2**30
SLACK = 1.05  # reserved / allocated of the bench on an H200 (expandable segments)
CONTEXT = GIB  # the CUDA context and libraries' workspaces (CPU: Python, torch); not measured
LOGITS = 2**29  # pith_ops.cross_entropy.CHUNK_LOGITS: the logits the fused loss holds at once
FSDP_UNIT = 10  # bytes an element of the unit at work: gathered, the next prefetched, 2+4 for its grads


class Layer(NamedTuple):
    dense: int  # parameters outside the routed experts (attention, norms, router, shared or dense MLP)
    experts: int  # the routed experts' (all E)
    gemm: int  # of which the 3-D GEMM weights (kept casts, FP8 copies, Muon)
    linear: int  # the projections' (pith_engine.layers.Linear)
    muon: int  # the hidden matrices Muon takes outside the experts
    io: int  # sum over the projections of in + out features: what stage 1 keeps per token
    F: int  # expert width; 0 for a dense layer


class Model(NamedTuple):
    layers: list[Layer]
    root: int  # embedding, final norm, lm_head: pipeline rank 0's
    lm_head: int
    E: int
    cfg: Any  # the model's config


def model_shape(model_cfg) -> Model:
    model = pith_models.build(model_cfg)  # meta
    muon, layers, count = {id(p) for p in hidden_matrices(model)}, [], lambda ps: sum(p.numel() for p in ps)
    for layer in held_layers(model).values():
        ex = list(layer.experts.parameters()) if layer.experts is not None else []
        lin = [x for x in layer.modules() if isinstance(x, nn.Linear) and x is not layer.router]
        mats = [p for p in layer.parameters() if id(p) in muon and p.ndim == 2]
        layers.append(Layer(
            count(layer.parameters()) - count(ex), count(ex), count(p for p in ex if p.ndim == 3),
            count(p for x in lin for p in x.parameters()), count(mats),
            sum(x.in_features + x.out_features for x in lin), layer.experts.w_down.shape[1] if ex else 0,
        ))  # fmt: skip
    root = count(p for n, p in model.named_parameters() if not n.startswith("layers."))
    return Model(layers, root, model.lm_head.weight.numel(), num_experts(model), model.cfg)


def in_flight(cfg: Config, L: int, rank: int) -> dict[int, float]:
    """Layer -> micro-batches whose activations of it pipeline rank `rank` holds at its peak. pp=1: one,
    two when F(m+1) runs whole before B(m) (under EP they interleave, a layer for a layer). DualPipeV:
    2pp-r-1 (+1 on the last rank) of chunk r and r+1 of chunk 2pp-1-r."""
    p = cfg.parallel
    if p.pp == 1:
        paired = p.overlap and cfg.micro_batches > 1
        return dict.fromkeys(range(L), 1 + paired * (1 if p.ep == 1 else 1 / L))
    spans, (a, b) = schedule.split_layers(L, p.pp), schedule.rank_chunks(p.pp, rank)
    return {
        **dict.fromkeys(spans[a], 2 * p.pp - rank - 1 + (rank == p.pp - 1)),
        **dict.fromkeys(spans[b], rank + 1),
    }


@dataclass
class Plan:
    terms: dict[str, float]  # bytes by term at the peak, adding up to the total
    moment: str  # which peak
    rank: int  # the pipeline rank
    capacity: float | None = None  # bytes the device holds for this rank (None: not known)
    total = property(lambda self: sum(self.terms.values()))
    needs = property(lambda self: self.total * SLACK + CONTEXT)
    fits = property(lambda self: self.capacity is None or self.needs <= self.capacity)


def rank_plan(cfg: Config, m: Model, rank: int, cuda: bool) -> list[Plan]:
    t, p, M, c = cfg.train, cfg.parallel, cfg.micro_batches, m.cfg
    b, D, K, E, V = (2 if cuda else 4), c.hidden_size, c.num_experts_per_tok, m.E, c.vocab_size  # autocast
    T = t.micro_batch * cfg.data.seq_len / p.cp
    flight = in_flight(cfg, len(m.layers), rank)
    mine, root, lm = [m.layers[i] for i in flight], m.root * (rank == 0), m.lm_head * (rank == 0)
    # FSDP2 shards dense weights over dp*cp*ep, this EP rank's experts over dp*cp (a group of one: plain).
    dense_ranks, expert_ranks = p.dp * p.cp * p.ep, p.dp * p.cp
    dense, ex = sum(x.dense for x in mine) + root, sum(x.experts for x in mine) / p.ep
    gemm, linear = sum(x.gemm for x in mine) / p.ep, sum(x.linear for x in mine)
    local = dense / dense_ranks + ex / expert_ranks
    whole = dense * (dense_ranks > 1) + ex * (expert_ranks > 1)  # what FSDP gathers
    muon = cfg.optim.name == "muon"
    muon_local = muon * (sum(x.muon for x in mine) / dense_ranks + gemm / expert_ranks)
    # Plain weights read through pith_ops.cast / stand_in keep a bf16 cast or FP8 copies (2 bytes) and
    # under AdamW a bf16 gradient after one micro-batch: the expert GEMMs', lm_head's, and the
    # projections' in eager FP8 (compiled ones quantise per call).
    ex_plain, lm_plain = gemm * (expert_ranks == 1), lm * (dense_ranks == 1)
    lin_plain = linear * (dense_ranks == 1 and t.fp8 and not (t.compile and cuda))
    copies = 2 * (ex_plain * (t.fp8 or b == 2) + lm_plain * (t.fp8_lm_head or b == 2) + lin_plain)
    kept_grad = (lm_plain + (not muon) * (ex_plain + lin_plain)) * (b == 2)

    def grads(done: int, final: bool) -> float:  # after `done` micro-batches' backward
        plain = kept_grad * (2 if done == 1 else 4) + (dense + ex - whole - kept_grad) * 4 if done else 0
        # FSDP: unsharded fp32 accumulators until the last micro-batch reduce-scatters, then shards
        return plain + (4 * (local - dense - ex + whole) if final else 4 * whole * (done > 0 or p.pp > 1))

    static = {
        "parameters": 4 * local,  # fp32 masters
        "optimizer state": 4 * muon_local + 8 * (local - muon_local),  # Muon's momentum, AdamW's 2 moments
        "weight copies": copies,
    }
    rows = 1 if t.fp8 else b  # the dispatched rows: e4m3 under FP8 (pith_ops.FP8Rows)
    u = p.ep * (1 - (1 - 1 / p.ep) ** K)  # EP ranks a token is sent to (uniform routing, deduplicated)

    # CPU attention (attention_reference): fp32 B x H x S x S (/ cp under CP), 2 kept, ~3 in the backward
    att = 4 * c.num_attention_heads * T * cfg.data.seq_len * (not cuda)

    def acts(x: Layer) -> float:  # one micro-batch's: each stage's inputs and outputs (executor.Tape)
        # and what its ops save, less what `ac` recomputes
        a = b * T * D  # the layer's output, the next one's input
        if t.ac != "full":  # stage 1: each projection's input and output (~), the router's fp32 input
            a += b * T * x.io + (4 - b) * T * D * bool(x.F) + 2 * att
        if not x.F:
            return a
        # the residual and the routed input; fp32 router logits and probs, int64 ids, fp32 weights; the
        # dispatched rows and the experts' outputs; under EP the rows sent both ways
        a += (2 * b * D + 8 * E + 12 * K) * T + (rows + b) * T * K * D
        a += (2 * rows + 2 * b) * T * u * D * (p.ep > 1)
        if t.ac == "none":  # stage 3: SwiGLU's input [2F], the down GEMM's [F]; under FP8 SwiGLU's
            # bf16 input, its e4m3 output and column copies of both GEMMs' inputs (for weight gradients)
            a += T * K * (2 * x.F * b + 2 * x.F + D if t.fp8 else 3 * x.F * b)
        return a

    act = sum(n * acts(m.layers[i]) for i, n in flight.items())
    if rank == 0:  # the embedding's output; the fused loss's dh and dw (computed in its forward)
        act += flight[0] * b * T * D + flight[next(reversed(flight))] * b * (T * D + V * D)
    big = max(mine, key=lambda x: x.dense + x.experts / p.ep)
    # Evaluation's forward (and a layer's backward's first half): the rows, the hidden [3F], the output
    rows_work = b * T * K * (2 * D + 3 * big.F)
    if rank == 0:  # the loss's forward: a chunk of logits; FP8: half, and e4m3 gradients of half the tokens
        rows_work = max(rows_work, b * min(LOGITS, T * V) / (1 + t.fp8_lm_head) + t.fp8_lm_head * T * V / 2)
    # a layer's backward: its rows' gradients, stage 3 (under full, 1 too) recomputed, its plain
    # weights' gradients (FSDP's count in communication)
    recompute = b * T * K * 3 * big.F * (t.ac != "none") + b * T * big.io * (t.ac == "full")
    wgrads = 4 * big.dense * (dense_ranks == 1) + (2 if b == 2 and not muon else 4) * big.experts / p.ep * (
        expert_ranks == 1)  # fmt: skip
    work = max(
        rows_work, b * T * K * (2 * D + 3 * big.F) + recompute + wgrads, (3 + 2 * (t.ac == "full")) * att
    )
    unit = big.dense + big.experts / p.ep * (expert_ranks > 1)
    comm = (2 * whole if p.pp > 1 else 2 * root + FSDP_UNIT * unit) * (dense_ranks > 1)  # pp>1: all gathered
    comm += 2 * b * T * D * (p.cp > 1)  # ring attention: the key/value blocks in flight (~D wide)
    done = max(0, M - int(max(flight.values()))) if p.pp == 1 else M - 1
    start = {**static, "gradients": grads(done, False), "activations": act, "working set": work,
             "communication": comm}  # fmt: skip
    # Muon: U = G + mu * B (fp32) and its orthogonalised O (bf16) of every matrix, and NS5 on the
    # largest batch (the experts' w_gate_up, 2/3 of their GEMM weights) a few times over
    muon_work = 6 * muon_local + muon * 6 * 2 / 3 * gemm / expert_ranks
    step = {**static, "gradients": grads(M, True), "optimizer working set": muon_work}
    if t.cuda_graph and cuda:  # the graph's pool keeps the backward's peak; the optimizer and
        start["beside the CUDA-graph pool"] = muon_work + rows_work  # evaluation allocate beside it
    return [Plan(start, "the start of the backward", rank), Plan(step, "the optimizer step", rank)]


def plan(cfg: Config, m: Model, cuda: bool, capacity: float | None = None) -> Plan:
    """The larger moment of the pipeline rank that holds the most."""
    out = max((x for r in range(cfg.parallel.pp) for x in rank_plan(cfg, m, r, cuda)), key=lambda x: x.total)
    out.capacity = capacity
    return out


def device_memory(device: torch.device, processes: int = 1) -> tuple[float, str]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, props.name
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    share = f" over {processes} processes" if processes > 1 else ""
    return kib * 1024 / processes, f"this machine's available RAM{share}"


def valid(cfg: Config, m: Model, world: int | None = None) -> None:
    p, S, limit = cfg.parallel, cfg.data.seq_len, m.cfg.max_position_embeddings
    if limit < S:
        raise ValueError(
            f"data.seq_len={S} is more than the model's max_position_embeddings ({limit}); lower data.seq_len"
        )
    layout = Layout(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep)
    check_layout(layout, world_size=world or layout.world, num_experts=m.E, seq_len=S,
                 global_batch=cfg.train.global_batch, micro_batch=cfg.train.micro_batch)  # fmt: skip
    schedule.check(p.pp, cfg.micro_batches, len(m.layers))


def changes(cfg: Config, m: Model, cuda: bool, capacity: float | None) -> list[tuple[str, Plan]]:
    """The nearest change that fits of each kind: a stronger `ac`, a smaller micro-batch, pipeline
    stages, more data ranks (dp, ep); the last two also with ac full. More ranks take more cards, or
    share a machine's `capacity`."""
    t, p, out, full = cfg.train, cfg.parallel, [], ({}, {"train.ac": "full"})
    mbs = [t.micro_batch >> i for i in range(t.micro_batch.bit_length())]  # it and its halves
    for kind in (
        [{"train.ac": a} for a in AC[AC.index(t.ac) + 1 :]],
        [{"train.micro_batch": mb} for mb in mbs[1:]],
        [{"parallel.pp": p.pp * n, **f, "train.micro_batch": mb} for n in (2, 4) for f in full for mb in mbs],
        [{"parallel.dp": p.dp * n // e, "parallel.ep": p.ep * e, "train.global_batch": t.global_batch * g,
          **f} for n in (2, 4, 8, 16, 32) for e in (1, 2, 4, 8) if e <= n for g in (1, n) for f in full],
    ):  # fmt: skip
        for change in kind:
            c, new = copy.deepcopy(cfg), []
            for key, value in change.items():  # as config.load_config sets --section.key=value
                section, name = key.split(".")
                new += [f"--{key}={value}"] * (getattr(getattr(c, section), name) != value)
                setattr(getattr(c, section), name, value)
            try:
                validate(c)
                valid(c, m)
            except ValueError:
                continue
            world = c.world
            share = 1 if cuda or capacity is None else world / cfg.world
            if (x := plan(c, m, cuda, capacity and capacity / share)).fits:
                out.append((" ".join(new) + (f" ({world} GPUs)" if cuda and world > 1 else ""), x))
                break
    return out


def terms(out: Plan) -> list[tuple[str, float]]:
    return [(k, v / GIB) for k, v in sorted(out.terms.items(), key=lambda kv: -kv[1])]  # GiB, largest first


def check(cfg: Config, model_cfg, device: torch.device, launch: str, started: int = 0) -> Plan:
    """ValueError when the layout does not match the processes `started` (else torchrun's; naming its
    line) or the plan does not fit `device`."""
    if device.type == "cpu" and cfg.train.cuda_graph:
        raise ValueError("train.cuda_graph needs a CUDA device, and this run is on the CPU: turn it off")
    m, started = model_shape(model_cfg), started or int(os.environ.get("WORLD_SIZE", 1))
    world = cfg.world
    try:
        valid(cfg, m, started)
    except ValueError as e:
        if started == world:
            raise
        raise ValueError(
            f"{e}: start it with torchrun --nproc-per-node {world} -m pith_train {launch}"
        ) from None
    capacity, what = device_memory(device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if (out := plan(cfg, m, device.type == "cuda", capacity)).fits:
        return out
    fixes = changes(cfg, m, device.type == "cuda", capacity)[:3]
    fix = " or ".join(f"{text} ({x.needs / GIB:.1f} GiB)" for text, x in fixes) or stuck(out)
    raise ValueError(
        f"plan: a rank of this run needs {out.needs / GIB:.1f} GiB (largest terms, GiB: "
        + ", ".join(f"{k} {v:.1f}" for k, v in terms(out)[:3])
        + f") and {what} is {capacity / GIB:.1f} GiB; it fits with {fix} (`pith-train plan` lists the terms)"
    )


def stuck(out: Plan) -> str:
    if out.total * SLACK < CONTEXT:  # the run's own terms are not what does not fit
        return (
            f"more memory: the fixed {CONTEXT / GIB:g} GiB a process holds (context, libraries) is most of it"
        )
    return "a smaller model"


def report(cfg: Config, m: Model, out: Plan, what: str, fixes: list[tuple[str, Plan]]) -> str:
    p, t, n = cfg.parallel, cfg.train, sum(x.dense + x.experts for x in m.layers) + m.root
    gap = abs((out.capacity or 0) - out.needs) / GIB
    return "\n".join([
        f"{cfg.model.name}, {n / 1e9:.2f}B parameters; ranks pp {p.pp} x dp {p.dp} x cp {p.cp} x ep {p.ep};"
        f" {cfg.micro_batches} micro-batch(es) of {t.micro_batch} x {cfg.data.seq_len} tokens; ac {t.ac}"
        + ", fp8" * t.fp8 + ", fp8 lm_head" * t.fp8_lm_head + ", CUDA graph" * t.cuda_graph,
        f"pipeline rank {out.rank} at {out.moment}, GiB:",
        *(f"  {k:<28}{v:9.2f}" for k, v in terms(out)),
        f"  {'total (allocated)':<28}{out.total / GIB:9.2f}",
        f"  {f'needs (x{SLACK} + {CONTEXT / GIB:g} GiB)':<28}{out.needs / GIB:9.2f}",
        "fits: not known (no CUDA device here: give --gpu-memory GiB)" if out.capacity is None
        else f"{'fits by' if out.fits else 'does not fit: short by'} {gap:.1f} GiB of {what}"
        f" ({out.capacity / GIB:.1f} GiB)",
        *(f"  fits with {text}: needs {x.needs / GIB:.1f} GiB" for text, x in fixes),
        *[f"  fits with {stuck(out)}"] * (not (out.fits or fixes)),
    ])  # fmt: skip
