"""Muon (pith_train.muon): each step against a float64 reference written from the algorithm, the split of a
model's parameters between Muon and AdamW, and (gloo, under torchrun's environment variables) dp2 / ep2 / dp2
x ep2 training the single-process losses, with a checkpoint of one layout resuming in another."""

import dataclasses
import json
import math
import shutil

import pith_models
import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st
from pith_engine.parallel import Layout, Mesh
from pith_train.config import load_config
from pith_train.muon import NS_COEFFICIENTS, Muon, _owners, hidden_matrices
from pith_train.optim import build_optimizer
from pith_train.train import pretrain
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def ns_reference(u_MN: torch.Tensor) -> torch.Tensor:
    """NS5 of one matrix in float64, as the algorithm states it."""
    a, b, c = NS_COEFFICIENTS
    tall = u_MN.shape[0] > u_MN.shape[1]
    x = u_MN.double().T if tall else u_MN.double()
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(5):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def muon_reference(w, grads, lr, mu, wd):
    """W after Muon steps with `grads`, in float64; a 3-D W is a stack of matrices."""
    w, buf = w.double(), torch.zeros_like(w, dtype=torch.float64)
    M, N = w.shape[-2:]
    for g in grads:
        buf = mu * buf + g.double()
        u = g.double() + mu * buf
        o = ns_reference(u) if w.ndim == 2 else torch.stack([ns_reference(m) for m in u])
        w = w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(M, N)) * o
    return w


def adamw_reference(w, grads, lr, wd, b1, b2, eps):
    w, m, v = w.double(), 0.0, 0.0
    for t, g in enumerate(grads, 1):
        m, v = b1 * m + (1 - b1) * g.double(), b2 * v + (1 - b2) * g.double() ** 2
        w = w * (1 - lr * wd) - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return w


@given(
    stack=st.sampled_from([None, 1, 3]),
    M=st.integers(1, 40),
    N=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
@example(stack=3, M=1, N=7, seed=0)  # one-row matrices
@example(stack=None, M=9, N=1, seed=0)  # one-column (tall: orthogonalised transposed)
def test_muon_steps_equal_the_float64_reference(stack, M, N, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (M, N) if stack is None else (stack, M, N)
    w0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    lr, mu, wd = 0.02, 0.9, 0.1
    want = muon_reference(w0, grads, lr, mu, wd)
    for dtype, ns_dtype in ((torch.float64, torch.float64), (torch.float32, torch.bfloat16)):
        w = torch.nn.Parameter(w0.to(dtype, copy=True))
        opt = Muon([w], lr, mu, wd, ns_dtype)
        for g in grads:
            w.grad = g.to(dtype)
            opt.step()
        # Exact in float64. bf16 NS5 (8 significant bits) differs by each iteration's bf16 rounding,
        # amplified by the iteration: up to 1.5% of one step's update size (lr * 0.2 * sqrt(max(M, N))
        # * ||O||, ||O|| ~ sqrt(min(M, N)) per matrix) over 300 random shapes up to 63 x 63.
        tol = 1e-10 if ns_dtype == torch.float64 else 0.05
        size = lr * 0.2 * math.sqrt(max(M, N) * min(M, N) * (stack or 1))
        err = (w.detach().double() - want).norm() / (len(grads) * size)
        assert err <= tol, (dtype, err)


# Row-sharded DTensors over 3 ranks (torch.chunk pieces: empty shards where rows run out) and stacks
# whose shards hold whole matrices (one rank holds none of the [2, 4, 6]).
SHARDED = [(1, 5), (2, 9), (7, 3), (5, 5), (1, 1), (3, 4, 6), (2, 4, 6)]


def _sharded_worker() -> None:
    """One rank of test_sharded_muon_...: two steps on Shard(0) DTensors equal the float64 reference."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHARDED]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for _ in range(2)] for s in SHARDED]
    params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in start]
    opt = Muon(params, 0.02, 0.9, 0.1, torch.float64)
    for step in range(2):
        for p, g in zip(params, grads):
            p.grad = distribute_tensor(g[step].clone(), mesh, [Shard(0)])
        opt.step()
    for p, w, g in zip(params, start, grads):
        torch.testing.assert_close(
            p.full_tensor(), muon_reference(w, g, 0.02, 0.9, 0.1), rtol=1e-10, atol=1e-12
        )
    # Every rank done before any tears the group down: a rank destroying gloo while a peer still waits
    # on a collective aborted once on this 2-core box ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_sharded_muon_orthogonalises_whole_matrices_once_and_equals_the_reference(run_ranks, tmp_path):
    run_ranks(__file__, 3, tmp_path, timeout=300)  # under torchrun's environment variables
    # Owners: one per matrix, the NS cost spread evenly (8 equal matrices over 4 ranks: 2 each).
    assert sorted(_owners([torch.Size((4, 6))] * 8, 4)) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_grad_scale_scales_the_gradients_and_a_non_finite_one_skips_the_step():
    """The trainer's clip coefficient (pith_train.train.train_step): step(grad_scale=coef) is Muon on
    coef * G; coef = nan (a non-finite step) leaves weights and momentum as they were."""
    gen = torch.Generator().manual_seed(0)
    for shape in ((5, 7), (2, 3, 4)):
        w0 = torch.randn(shape, generator=gen, dtype=torch.float64)
        g1, g2, g3 = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
        w = torch.nn.Parameter(w0.clone())
        opt = Muon([w], 0.02, 0.9, 0.1, torch.float64)
        for g, coef in ((g1, 0.5), (g2.masked_fill(g2 > 1, float("inf")), float("nan")), (g3, 1.0)):
            w.grad = g.clone()
            opt.step(grad_scale=torch.tensor([coef], dtype=torch.float64))
        want = muon_reference(w0, [0.5 * g1, g3], 0.02, 0.9, 0.1)
        torch.testing.assert_close(w.detach(), want, rtol=1e-10, atol=1e-12)


def _model_and_optimizer(name: str, optimizer: str):
    model = pith_models.build(name, "cpu", seed=0)  # fp32: pith_ops.adamw_ takes fp32 only
    cfg = load_config(None, [f"--optim.name={optimizer}", "--train.lr=0.01", "--optim.weight_decay=0.1"])
    return model, cfg, build_optimizer(model, cfg)


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v2-tiny", "gpt-oss-tiny"])
def test_every_parameter_kind_gets_its_reference_update(name):
    """Muon on the hidden matrices (each expert's its own), AdamW on embeddings, lm_head, norms, biases,
    routers, sinks; two steps of each equal the float64 references (NS5 in float64 here)."""
    model, cfg, chain = _model_and_optimizer(name, "muon")
    adamw, muon = chain.optimizers
    muon.ns_dtype = torch.float64
    o = cfg.optim
    names = {id(p): n for n, p in model.named_parameters()}
    on_muon = {names[id(p)] for p in hidden_matrices(model)}
    # The split, by name: every 2-D weight of attention and MLPs, every stacked expert weight.
    for n, p in model.named_parameters():
        matrix = p.ndim == 2 and ("proj" in n) or n.endswith(("experts.w_gate_up", "experts.w_down"))
        assert (n in on_muon) == matrix, n
    assert {names[id(p)] for g in muon.param_groups for p in g["params"]} == on_muon
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    grads = {
        n: [torch.randn(p.shape, generator=gen, dtype=p.dtype) for _ in range(2)] for n, p in start.items()
    }
    for step in range(2):
        for n, p in model.named_parameters():
            p.grad = grads[n][step].clone()
        chain.step()
        chain.zero_grad()
    decay = {names[id(p)]: g["weight_decay"] for g in adamw.param_groups for p in g["params"]}
    for n, p in model.named_parameters():
        if n in on_muon:
            want = muon_reference(start[n], grads[n], cfg.train.lr, o.muon_momentum, o.weight_decay)
        else:
            want = adamw_reference(start[n], grads[n], cfg.train.lr, decay[n], o.beta1, o.beta2, o.eps)
        # fp32 weights against float64 references: fp32 rounding, 1e-4 of an update of ~lr.
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6, msg=n)


def test_bad_optimizer_settings_are_named():
    with pytest.raises(ValueError, match="optim.name: expected 'adamw' or 'muon', got 'sgd'"):
        load_config(None, ["--optim.name=sgd"])
    with pytest.raises(ValueError, match=r"optim.muon_momentum must be in \[0, 1\), got 1.0"):
        load_config(None, ["--optim.muon_momentum=1"])


def test_resuming_with_the_other_optimizer_stops_naming_it(micro_config, tmp_path):
    pretrain(micro_config("--train.device=cpu", "--train.steps=2"), tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"holds adamw.s optimizer state: set optim.name=adamw"):
        pretrain(micro_config("--train.device=cpu", "--train.steps=4", "--optim.name=muon"), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == before


def _losses(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def _assert_same_losses(got, want, what, rtol=1e-5):
    assert [s for s, _ in got] == [s for s, _ in want], (what, got)
    for (step, loss), (_, ref) in zip(got, want):
        assert abs(loss - ref) <= rtol * abs(ref), f"{what} step {step}: {loss} vs single process {ref}"


# Adam's eps as in test_torchrun.py (fp32 summation-order noise in near-zero gradients); 5 steps.
MUON = ["--optim.name=muon", "--optim.eps=1e-3", "--train.device=cpu", "--train.steps=5"]
FP32_NS = ["--optim.muon_ns_dtype=float32"]


def test_a_pipeline_rank_without_the_embedding_gives_muon_its_hidden_matrices():
    """Pipeline ranks but the first hold no embedding or lm_head (Muon under pp once stopped there)."""
    cfg = dataclasses.replace(pith_models.MODELS["qwen3-moe-tiny"], num_hidden_layers=4, mlp_only_layers=())
    names = lambda m: {n for n, p in m.named_parameters() if any(p is q for q in hidden_matrices(m))}
    ranks = [pith_models.build(cfg, mesh=Mesh(Layout(pp=2), torch.device("cpu"), pp_rank=r)) for r in (0, 1)]
    first, second = map(names, ranks)
    assert first and second and not first & second and first | second == names(pith_models.build(cfg))


@pytest.mark.distributed
def test_torchrun_dp2_ep2_dp2xep2_train_the_single_process_losses_and_resume_elsewhere(
    micro_config, micro_args, tmp_path, pretrains_in_ranks
):
    """fp32 Newton-Schulz: every layout within 1e-5 of one process (fp32 summation order only). bf16
    (the default): the gradients' fp32 noise flips bf16 roundings inside NS5, which the iteration and
    the following steps amplify: ep2 measured 1.6e-5 at step 5 (fp32 NS: 0), hence 1e-4 there."""
    # dp2 and ep2: 2 data ranks x micro-batch 1 = the single run's micro-batch of 2; dp2 x ep2: 4 data
    # ranks, so global batch 8 in micro-batches of 4 on one process.
    big = ["--train.global_batch=8"]
    runs = [("dp2", ["--parallel.dp=2"], [], FP32_NS), ("ep2", ["--parallel.ep=2"], [], FP32_NS)]
    runs += [("dp2_ep2", ["--parallel.dp=2", "--parallel.ep=2"], big, ns) for ns in (FP32_NS, [])]
    layouts = {2: [], 4: []}  # one start per world size (process start dominates)
    for name, layout, batch, ns in runs:
        single = tmp_path / ("single" + "_".join(batch + ns))
        if not single.exists():
            pretrain(micro_config(*MUON, *ns, *batch, *(["--train.micro_batch=4"] if batch else [])), single)
        args = [*micro_args, *MUON, *layout, *ns, *batch, "--train.micro_batch=1"]
        layouts[2 * len(layout)].append((tmp_path / (name + "_".join(ns)), args))
    # The 4-process runs first: dp2 resumes dp2 x ep2's step-4 checkpoint (Muon's momentum one entry per
    # expert); so does one process; both take step 5 as the uninterrupted single-process run did.
    pretrains_in_ranks(4, layouts[4])
    ckpt = tmp_path / ("dp2_ep2" + "_".join(FP32_NS)) / "checkpoints" / "step_000004"
    keys = set(FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    assert {f"optim.state.layers.1.mlp.experts.w_down.{e}.momentum_buffer" for e in range(4)} <= keys
    assert "optim.state.layers.0.self_attn.q_proj.weight.momentum_buffer" in keys
    assert "optim.state.layers.0.mlp.gate.weight.exp_avg_sq" in keys
    for name in ("resumed_1", "resumed_dp2"):
        shutil.copytree(ckpt, tmp_path / name / "checkpoints" / ckpt.name)
    resumed = [*micro_args, *MUON, "--parallel.dp=2", *FP32_NS, *big, "--train.micro_batch=2"]
    pretrains_in_ranks(2, [*layouts[2], (tmp_path / "resumed_dp2", resumed)])
    for name, _, batch, ns in runs:
        got, single = (
            _losses(tmp_path / (name + "_".join(ns))),
            _losses(tmp_path / ("single" + "_".join(batch + ns))),
        )
        _assert_same_losses(got, single, f"{name} {ns}", 1e-5 if ns else 1e-4)
    pretrain(micro_config(*MUON, *FP32_NS, *big, "--train.micro_batch=4"), tmp_path / "resumed_1")
    want = _losses(tmp_path / ("single" + "_".join(big + FP32_NS)))[4:]
    for name in ("resumed_1", "resumed_dp2"):
        _assert_same_losses(_losses(tmp_path / name), want, name)


if __name__ == "__main__":
    _sharded_worker()
