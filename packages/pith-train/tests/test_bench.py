import inspect
import json
import math
from types import SimpleNamespace

import pith_models
import pytest
import torch
from pith_train import bench
from pith_train.cli import main
from pith_train.config import AC
from pith_train.train import flops_per_token


def test_workload_is_the_issue_geometry_with_its_parameter_counts():
    model = pith_models.build(bench.WORKLOAD)  # meta device: no memory
    c = bench.WORKLOAD
    D, H, G, Dh, E, K, F, V = (
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.num_experts,
        c.num_experts_per_tok, c.moe_intermediate_size, c.vocab_size,
    )  # fmt: skip
    assert (c.num_hidden_layers, D, H, G, Dh, E, K, F, V) == (4, 2048, 32, 4, 128, 128, 8, 768, 151936)
    assert round(pith_models.param_count(model) / 1e9, 2) == 3.11
    # Active weights a token passes through, by hand: attention, router, K of E experts, lm_head.
    per_layer = D * (H + 2 * G) * Dh + H * Dh * D + D * E + K * 3 * D * F
    active = c.num_hidden_layers * per_layer + V * D
    assert flops_per_token(model, 0) == pytest.approx(6 * active, rel=1e-6)
    assert round((active + V * D) / 1e9, 2) == 0.85  # the issue's 0.85B counts the embedding too
    S = bench.WORKLOAD_SEQ_LEN  # full-square attention term: 6 * L * S * H * 2 * Dh
    assert flops_per_token(model, S) - flops_per_token(model, 0) == 6 * 4 * S * H * 2 * Dh


_CUTLASS_GROUPED = "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShape"
_CUTLASS_TAIL = "NS_6half_tENS_6layout8RowMajorEEEvNT_6ParamsE"


@pytest.mark.parametrize(
    "name, ranges, component",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", {"lm_head+loss", "ProfilerStep"}, "lm_head + loss"),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", set(), "optimizer"),
        ("triton_poi_fused_mul_0", {"optimizer"}, "optimizer"),
        ("flash_fwd_kernel<Flash_fwd_kernel_traits>", set(), "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", set(), "attention"),
        ("_grouped_mm_kernel", set(), "expert GEMMs"),
        ("cutlass::device_kernel<GroupedGemm>", set(), "expert GEMMs"),
        ("cutlass::device_kernel<Sm90Kernel>", {"aten::_grouped_mm", "GroupedMmBackward0"}, "expert GEMMs"),
        ("triton_scatter_kernel", {"pith::moe_permute"}, "router + permutation"),
        ("cutlass::device_kernel<Sm90Kernel>", {"aten::mm"}, "other GEMMs"),
        ("_gather_rows_kernel", set(), "router + permutation"),
        ("triton_per_fused__softmax_topk_3", set(), "router + permutation"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", set(), "other GEMMs"),
        ("triton_poi_fused_add_rms_norm_2", set(), "other"),
        # Replayed under cuda_graph (no launching op): the names an H200 profile showed (torch 2.11).
        (_CUTLASS_GROUPED + "N7cutlass12float_e4m3_tE" + _CUTLASS_TAIL, set(), "FP8 GEMMs"),
        (_CUTLASS_GROUPED + "N7cutlass10bfloat16_tE" + _CUTLASS_TAIL, set(), "expert GEMMs"),
        ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT", set(), "FP8 GEMMs"),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_badd_coopA_NTT", set(), "other GEMMs"),
        ("vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::Float8_e4m3fn>>", set(), "other"),
    ],
)
def test_profile_components_come_from_ranges_first_then_kernel_names(name, ranges, component):
    assert bench.classify(name, ranges) == component


def test_bench_tiny_on_cpu_reports_consistent_numbers_and_a_breakdown(tmp_path):
    out = tmp_path / "bench.json"
    main(["bench", "--tiny", "--steps=1", "--warmup=0", "--profile=1", "--device=cpu", f"--json={out}"])
    r = json.loads(out.read_text())
    w = r["workload"]
    assert r["card"] == "cpu" and w["tokens_per_step"] == bench.TINY_SEQ_LEN * bench.TINY_BATCH
    assert r["tokens_per_s"] == pytest.approx(w["tokens_per_step"] / (r["step_ms"] / 1e3))
    full, causal = r["flops_per_token_full"], r["flops_per_token_causal"]
    assert 6 * w["active_params_nonembed"] < causal < full
    assert r["mfu_989"] == pytest.approx(full * r["tokens_per_s"] / (r["datasheet_tflops"] * 1e12))
    assert r["mfu_measured"] == pytest.approx(
        causal * r["tokens_per_s"] / (r["measured_matmul_tflops"] * 1e12)
    )
    # Random tokens against weights drawn with std 0.02: the first loss is about ln(V).
    assert r["losses"][0] == pytest.approx(math.log(bench.TINY.vocab_size), abs=0.05)
    parts = r["breakdown_ms_per_step"]
    assert list(parts) == list(bench.COMPONENTS)
    assert parts["optimizer"] > 0 and parts["lm_head + loss"] > 0  # the trainer's marked ranges


@pytest.fixture(scope="module")
def tiny_result():
    return bench.run(tiny=True, steps=1, warmup=0, device="cpu")


def _bench_cli(monkeypatch, result, *flags):
    """`pith-train bench --tiny FLAGS` measuring `result` (the record and the comparison, not the step)."""
    real = inspect.signature(bench.run)
    monkeypatch.setattr(bench, "run", lambda **kw: real.bind(**kw) and result)  # run's own arguments
    main(["bench", "--tiny", "--device=cpu", "--json=bench.json", *flags])


def test_a_record_compares_equal_to_itself_and_is_replaced_for_the_same_settings(
    tiny_result, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    monkeypatch.setenv("PITH_COMMIT", "abc1234")
    _bench_cli(monkeypatch, tiny_result, "--record")
    _bench_cli(monkeypatch, tiny_result, "--compare", "--record")  # the comparison first: passes
    out = capsys.readouterr().out
    assert f"tokens_per_s {tiny_result['tokens_per_s']:,.0f} against" in out and ": 1.000" in out
    (record,) = json.loads((tmp_path / "benchmarks" / "cpu.json").read_text())
    assert (record["card"], record["commit"], record["tokens_per_s"]) == (
        "cpu",
        "abc1234",
        tiny_result["tokens_per_s"],
    )
    assert record["settings"]["fp8"] is False and record["settings"]["layers"] == bench.TINY.num_hidden_layers
    assert "torch" not in record["settings"] and record["torch"] == torch.__version__
    other = {**tiny_result, "settings": {**tiny_result["settings"], "fp8": True}}
    _bench_cli(monkeypatch, other, "--record")  # other settings: a second record beside the first
    records = json.loads((tmp_path / "benchmarks" / "cpu.json").read_text())
    assert [r["settings"]["fp8"] for r in records] == [False, True]


def test_compare_exits_1_naming_the_figure_and_ratio_below_the_floor_or_without_a_record(
    tiny_result, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    with pytest.raises(SystemExit) as exit:
        _bench_cli(monkeypatch, tiny_result, "--compare")
    assert exit.value.code == 1
    assert "no record for cpu with these settings in benchmarks/cpu.json" in capsys.readouterr().out
    _bench_cli(monkeypatch, tiny_result, "--record")
    path = tmp_path / "benchmarks" / "cpu.json"
    (record,) = json.loads(path.read_text())
    record["tokens_per_s"] *= 1.1  # a record 10% faster than the measurement
    path.write_text(json.dumps([record]))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        _bench_cli(monkeypatch, tiny_result, "--compare")
    assert exit.value.code == 1
    measured, recorded = tiny_result["tokens_per_s"], record["tokens_per_s"]
    low = f"tokens_per_s {measured:,.0f} against {recorded:,.0f}: 0.909, below 0.97"
    assert low in capsys.readouterr().out
    record["tokens_per_s"] /= 1.1 / 1.02  # 2% faster: within the floor
    path.write_text(json.dumps([record]))
    _bench_cli(monkeypatch, tiny_result, "--compare")
    assert ": 0.980" in capsys.readouterr().out


def test_bad_settings_are_value_errors_before_any_compute():
    with pytest.raises(ValueError, match="expected steps >= 1.*got 0"):
        bench.run(tiny=True, steps=0)
    with pytest.raises(ValueError, match="grouped_gemm: expected torch or triton, got 'cublas'"):
        bench.run(tiny=True, grouped_gemm="cublas")
    with pytest.raises(ValueError, match="train.ac: expected 'none', 'selective' or 'full', got 'some'"):
        bench.run(tiny=True, ac="some")
    for bad in (0, 3):  # the tiny batch's sequences per data rank do not split into micro-batches of 3
        with pytest.raises(ValueError, match=f"micro_batch: expected a divisor of the .* got {bad}"):
            bench.run(tiny=True, micro_batch=bad)
    with pytest.raises(ValueError, match=r"memory_peak records .* \(got cpu, warmup 3\)"):
        bench.run(tiny=True, device="cpu", memory_peak=True)


def test_recompute_policies_train_exactly_like_no_recompute():
    # The second step's loss depends on the first step's gradients: equal losses, equal updates.
    runs = {ac: bench.run(tiny=True, steps=2, warmup=0, ac=ac, device="cpu")["losses"] for ac in AC}
    assert runs["selective"] == runs["none"] and runs["full"] == runs["none"]
    assert runs["none"][1] != runs["none"][0]


def test_cuda_breakdown_attributes_linked_kernels_by_range_and_counts_each_once():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device_type, us=0.0, parent=None, kernels=(), annotation=False):
        return SimpleNamespace(
            name=name, device_type=device_type, time_range=SimpleNamespace(start=0.0, end=us),
            cpu_parent=parent, kernels=list(kernels), is_user_annotation=annotation, self_cpu_time_total=0.0,
        )  # fmt: skip

    gemm = SimpleNamespace(name="nvjet_gemm", duration=300.0)
    loss_range = event("lm_head+loss", cpu)
    mm = event("aten::mm", cpu, parent=loss_range, kernels=[gemm])  # the loss's chunk matmul
    events = [
        loss_range,
        mm,
        event("lm_head+loss", cuda, 900.0, annotation=True),  # the range's device-side span: not work
        event("nvjet_gemm", cuda, 300.0),  # linked to aten::mm above
        event("nvjet_gemm", cuda, 200.0),  # an attention projection's matmul, unlinked
        event("flash_fwd_kernel", cuda, 100.0),
    ]
    parts = bench.breakdown(SimpleNamespace(events=lambda: events), steps=2)
    assert parts["lm_head + loss"] == 0.15 and parts["other GEMMs"] == 0.1 and parts["attention"] == 0.05
    assert sum(parts.values()) == pytest.approx(0.3)


@pytest.mark.gpu
def test_bench_on_cuda_names_every_component_of_a_reduced_workload():
    # Full width, one layer, 2 x 1024 tokens: the real kernels, so the name rules meet real names.
    r = bench.run(
        layers=1, seq_len=1024, batch=2, steps=2, warmup=1, compile=False, profile_steps=1, memory_peak=True
    )
    assert r["card"] == torch.cuda.get_device_name() and r["peak_allocated_gib"] > 0
    at_peak = r["memory_at_peak"]
    assert 0 < at_peak["peak_gib"] <= r["peak_allocated_gib"] and at_peak["sites"][0]["gib"] > 0
    assert all(math.isfinite(x) for x in r["losses"])
    parts = r["breakdown_ms_per_step"]
    for component in ("attention", "expert GEMMs", "router + permutation", "lm_head + loss", "optimizer"):
        assert parts[component] > 0, (component, parts)
    # The fused loss and AdamW dominate at one layer; "other" must not swallow them.
    assert parts["lm_head + loss"] + parts["optimizer"] > parts["other"], parts


def test_idle_counts_time_with_no_device_activity_on_any_stream():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    span = lambda name, start, end, device=cuda: SimpleNamespace(  # noqa: E731
        name=name,
        device_type=device,
        time_range=SimpleNamespace(start=start, end=end),
        is_user_annotation=False,
    )
    events = [
        span("a", 0, 100), span("b", 50, 120),  # overlapping streams: no gap
        span("c", 125, 200),  # 5 us launch gap
        span("host op", 200, 900, cpu),  # CPU time is no device activity
        span("d", 1200, 1300),  # 1000 us: the CPU fell behind
    ]  # fmt: skip
    i = bench.idle(SimpleNamespace(events=lambda: events), steps=2)
    assert i["idle_ms_per_step"] == pytest.approx(1.005 / 2) and i["gaps_per_step"] == 1
    assert i["by_length_ms_per_step"] == pytest.approx(
        {"under 10 us": 0.0025, "10-100 us": 0, "over 100 us": 0.5}
    )
    assert i["longest"][0] == {"us": 1000, "after": "c", "before": "d"}
    assert bench.idle(SimpleNamespace(events=lambda: events[3:4]), steps=1) is None


def test_a_perturbed_start_moves_the_loss_by_a_bf16_rounding_not_more():
    base, moved = (
        bench.run(tiny=True, steps=1, warmup=0, device="cpu", perturb_seed=s)["losses"][0] for s in (None, 1)
    )
    assert base != moved and abs(base - moved) < 1e-3 * base


def test_memory_at_peak_replays_the_trace_to_its_largest_total_and_groups_the_live_blocks_by_site():
    """Blocks freed before the peak are not counted, a free of a block allocated before the recording
    lowers the total, a free requested but not completed does not, and a site is the innermost frame
    in pith's packages (else the innermost)."""
    frame = lambda path, line, name: {"filename": path, "line": line, "name": name}  # noqa: E731
    ops = frame("/r/packages/pith-ops/src/pith_ops/cross_entropy.py", 9, "_lce_op")
    torch_only = [frame("/venv/torch/nn/functional.py", 3, "linear"), frame("/venv/torch/x.py", 1, "y")]
    events = [
        ("alloc", 1, 100, [frame("/venv/torch/a.py", 5, "f"), ops]),
        ("alloc", 2, 50, torch_only),
        ("free_requested", 1, 100, []),
        ("free_completed", 1, 100, []),
        ("free_completed", 9, 30, []),  # allocated before the recording
        ("alloc", 3, 200, [frame("/r/packages/pith-engine/src/pith_engine/layers.py", 4, "gemm")]),
        ("alloc", 4, 10, [ops]),
        ("free_completed", 3, 200, []),
        ("alloc", 5, 150, [ops]),
    ]
    trace = [{"action": a, "addr": addr, "size": n, "frames": f} for a, addr, n, f in events]
    got = bench.memory_at_peak({"device_traces": [[], trace]}, device=1)
    assert got["complete"]
    assert got["peak_gib"] * 2**30 == 50 - 30 + 200 + 10
    assert [(s["gib"] * 2**30, s["blocks"], s["site"]) for s in got["sites"]] == [
        (200, 1, "pith_engine/layers.py:4 gemm"),
        (50, 1, "/venv/torch/nn/functional.py:3 linear"),
        (10, 1, "pith_ops/cross_entropy.py:9 _lce_op"),
    ]
