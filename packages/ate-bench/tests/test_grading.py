"""Grading checks: Q&A citations against a worktree, the operate-task artifact checks, the .npz
reader (cross-checked against numpy's writer), the loss-curve check and the judge protocol."""

import json
import math
import subprocess

import numpy as np
import pytest
from ate_bench.grading import (
    MAX_NEW_FILE_BYTES,
    answer_identifiers,
    attempt_diff,
    check_citations,
    check_loss_curve,
    check_routing_trace,
    check_smoke_log,
    check_top_kernels,
    check_train_eval,
    grade_qa,
    run_judge,
)
from ate_bench.npz import load_npz

MODEL_PY = """\
import torch


class SwiGLU(torch.nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w_gate_up = torch.nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(torch.nn.functional.silu(gate) * up)
"""


@pytest.fixture
def worktree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "model.py").write_text(MODEL_PY)
    return tmp_path


def test_identifiers_come_from_code_spans_and_code_like_words():
    names = answer_identifiers("The `SwiGLU.forward` calls chunk() on w_gate_up output; see pkg/model.py:11.")
    assert {"SwiGLU", "forward", "chunk", "w_gate_up"} <= names
    assert "model" not in names and "see" not in names  # file names and prose are not identifiers


def test_right_citations_pass(worktree):
    answer = (
        "The fused weight `w_gate_up` is created at pkg/model.py:7 and split with `chunk` at "
        "pkg/model.py:11; `silu` is applied to the gate half (pkg/model.py:12)."
    )
    result = check_citations(answer, worktree)
    assert result["citations_total"] == 3 and result["citations_ok"], result


def test_neighbouring_line_is_enough_but_far_lines_are_not(worktree):
    near = check_citations("`w_down` is defined near pkg/model.py:10.", worktree)  # defined on line 8
    assert near["citations_ok"]
    far = check_citations("`w_down` is defined at pkg/model.py:2.", worktree)
    assert not far["citations_ok"] and "no identifier" in far["citations"][0]["reason"]


@pytest.mark.parametrize(
    ("citation", "reason"),
    [
        ("pkg/model.py:99", "out of range"),
        ("pkg/missing.py:3", "no such file"),
        ("../outside.py:1", "leaves the worktree"),
        ("/etc/hostname.py:1", "outside the attempt's worktree"),
        ("pkg/long.py:1-60", "span wider"),
    ],
)
def test_wrong_citations_fail(worktree, citation, reason):
    (worktree.parent / "outside.py").write_text("w_gate_up = 1\n")
    (worktree / "pkg" / "long.py").write_text("w_gate_up = 1\n" * 100)
    result = check_citations(f"The split happens in `w_gate_up` ({citation}).", worktree)
    assert not result["citations_ok"] and reason in result["citations"][0]["reason"]


def test_absolute_paths_inside_the_worktree_are_accepted(worktree):
    answer = f"`chunk` splits the projection at {worktree}/pkg/model.py:11."
    assert check_citations(answer, worktree)["citations_ok"]


def test_qa_verdicts(worktree):
    good = grade_qa("Done.\n<final_answer>`chunk` at pkg/model.py:11</final_answer>", worktree)
    assert good["verdict"] == "NEEDS_HUMAN" and good["answer"] == "`chunk` at pkg/model.py:11"
    assert grade_qa("no tags here", worktree)["verdict"] == "FAIL"
    assert grade_qa("<final_answer>it uses chunk</final_answer>", worktree)["reason"].endswith("no path:line")
    bad = grade_qa("<final_answer>`chunk` at pkg/model.py:2 and pkg/model.py:11</final_answer>", worktree)
    assert bad["verdict"] == "FAIL" and bad["citations_valid"] == 1


PITH_TQDM = (
    "\r  0%|          | 0/5 [00:00<?, ?step/s]\r 80%|########  | 4/5 [00:01<00:00,  2.3step/s, load=3.96, "
    "loss=4.146, lr=1.00e-03]\r100%|##########| 5/5 [00:02<00:00,  1.9step/s, load=3.96, loss=4.146, "
    "lr=1.00e-03]\r100%|##########| 5/5 [00:02<00:00,  1.9step/s, load=3.96, loss=4.009, lr=1.25e-03]\n"
)


@pytest.mark.parametrize(
    ("log", "ok"),
    [
        ("step 4 | loss 7.95\nstep 5 | loss 7.91 | 1200 tok/s\n", True),
        ("step 5 loss 7.91 lr 3.0e-03 grad_norm 1.2 tok/s 2311\n", True),  # the trainer's per-step line
        ("step=5 loss=7.91 lr=0.003\n", True),
        (" iteration        5/     100 | lm loss: 7.126E+00 |\n", True),
        ("[rank0]: step:  5  loss:  9.8012  memory: 3.1GiB\n", True),
        ("\x1b[31mstep:  5  \x1b[32mloss:  9.8012  \x1b[33mmemory: 3.1GiB\x1b[39m\n", True),  # TorchTitan
        (PITH_TQDM, True),  # tqdm redraws with carriage returns; the postfix carries the loss
        ('{"step": 4, "loss": 7.95}\n{"step": 5, "loss": 7.91, "lr": 0.003}\n', True),
        ("step 5 loss nan\n", False),
        ("step 15 loss 3.2\nstep 50 loss 3.0\n", False),
        ("step 4 loss 7.9\n", False),
        ('{"step": 5, "loss": NaN}\n', False),
        ("tokenizing: 5/168 [00:00<00:01, tokens=41,707]\n", False),  # a bar without a loss
    ],
)
def test_smoke_log_needs_a_finite_loss_at_step_5(tmp_path, log, ok):
    (tmp_path / "smoke.log").write_text(log)
    assert check_smoke_log({"file": "smoke.log", "step": 5}, tmp_path)[0] is ok


def test_smoke_log_takes_the_bar_s_last_redraw_and_metrics_beside_it(tmp_path):
    spec = {"file": "smoke.log", "step": 5}
    (tmp_path / "smoke.log").write_text(PITH_TQDM)
    assert check_smoke_log(spec, tmp_path) == (True, "smoke.log: step 5 loss 4.009")
    (tmp_path / "smoke.log").write_text("tiny-moe on cpu, from step 0\ndone\n")  # progress bar off
    (tmp_path / "metrics.jsonl").write_text(
        "".join(f'{{"step": {s}, "loss": {8 - s / 10}}}\n' for s in (1, 5))
    )
    assert check_smoke_log(spec, tmp_path) == (True, "metrics.jsonl: step 5 loss 7.5")


def test_smoke_log_failure_says_what_was_looked_for_and_where(tmp_path):
    spec = {"file": "smoke.log", "step": 5}
    ok, detail = check_smoke_log(spec, tmp_path)
    assert not ok and detail == f"smoke.log not found in {tmp_path}"
    (tmp_path / "smoke.log").write_text("step 1 loss 8.0\nstep 3 loss 7.0\n")
    ok, detail = check_smoke_log(spec, tmp_path)
    assert not ok and f"no report of step 5 with a loss in smoke.log (in {tmp_path})" in detail
    assert (
        "tqdm bar 'N/M [... loss=X]'" in detail and "found smoke.log: losses for 2 step(s), 1 to 3" in detail
    )
    (tmp_path / "smoke.log").write_text("step 5 loss inf\n")
    assert check_smoke_log(spec, tmp_path) == (False, "smoke.log: the loss at step 5 is not finite: inf")


def test_train_eval_needs_export_and_finite_score(tmp_path):
    spec = {"export_dir": "hf", "eval_file": "eval.json"}
    assert not check_train_eval(spec, tmp_path)[0]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\0" * 16)
    (tmp_path / "eval.json").write_text('{"score": NaN}')
    assert check_train_eval(spec, tmp_path) == (False, "eval.json: the score is not a finite number: nan")
    (tmp_path / "eval.json").write_text('{"score": 31.7}')
    assert check_train_eval(spec, tmp_path) == (True, "export with 1 weight file(s), eval score 31.7")


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("dtype", ["<f2", "<f4", ">f8", "<i8", "|u1", "?"])
def test_npz_reader_matches_numpy(tmp_path, compressed, dtype):
    rng = np.random.default_rng(0)
    array = (rng.random((2, 3, 5)) * 100).astype(dtype)
    fortran = np.asfortranarray(array)
    (np.savez_compressed if compressed else np.savez)(tmp_path / "a.npz", c=array, f=fortran, s=np.int64(7))
    arrays = load_npz(tmp_path / "a.npz")
    for name in ("c", "f"):
        assert arrays[name].shape == (2, 3, 5)
        got, want = arrays[name].values, array.ravel().tolist()
        assert got == want or all(math.isclose(g, w, rel_tol=1e-3) for g, w in zip(got, want))
    assert arrays["s"].shape == () and arrays["s"].values == [7]


def write_trace(directory, ids, weights, experts=8, name="step-00000010.npz"):
    directory.mkdir(exist_ok=True)
    np.savez(directory / name, expert_ids=ids, gate_weights=weights, num_experts=np.int64(experts))


def good_trace(tokens=256, layers=2, k=2, dtype=np.float32):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 8, size=(layers, tokens, k))
    weights = rng.random((layers, tokens, k)) + 0.1
    return ids, (weights / weights.sum(-1, keepdims=True)).astype(dtype)


def test_routing_trace_schema(tmp_path):
    spec = {"dir": "routing", "tokens": 256}
    assert not check_routing_trace(spec, tmp_path)[0]
    ids, weights = good_trace()
    write_trace(tmp_path / "routing", ids, weights)
    write_trace(tmp_path / "routing", *good_trace(dtype=np.float16), name="step-00000020.npz")
    assert check_routing_trace(spec, tmp_path) == (True, "2 trace file(s) match the schema")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda ids, w: (ids + 8, w), "outside [0, 8)"),
        (lambda ids, w: (ids, -w), "non-negative"),
        (lambda ids, w: (ids, w * 1.1), "sum to 1"),
        (lambda ids, w: (ids[:, :100], w[:, :100]), "shape [L, 256, k]"),
        (lambda ids, w: (ids.astype(np.float32), w), "integer expert_ids"),
    ],
)
def test_routing_trace_rejects_broken_files(tmp_path, change, message):
    write_trace(tmp_path / "routing", *change(*good_trace()))
    ok, detail = check_routing_trace({"dir": "routing", "tokens": 256}, tmp_path)
    assert not ok and detail.startswith("routing/step-00000010.npz: ") and message in detail


KERNELS = """kernel_name,total_time_ms,instances,mean_time_ms
sm90_xmma_gemm_bf16bf16,412.5,96,4.297
flash_fwd_kernel,120.0,24,5.0
triton_grouped_gemm,80.25,48,1.672
"""


@pytest.mark.parametrize(
    ("table", "profile", "ok"),
    [
        (KERNELS, True, True),
        (KERNELS, False, False),
        (KERNELS.replace("mean_time_ms\n", "mean_ms\n"), True, False),
        ("\n".join(KERNELS.splitlines()[:3]) + "\n", True, False),
        (KERNELS.replace("120.0,24,5.0", "1200.0,24,50.0"), True, False),  # not heaviest first
        (KERNELS.replace("4.297", "9.9"), True, False),  # mean != total / instances
    ],
)
def test_top_kernels_table(tmp_path, table, profile, ok):
    (tmp_path / "top-kernels.csv").write_text(table)
    if profile:
        (tmp_path / "profile.pt.trace.json").write_text("{}")
    passed, detail = check_top_kernels({"file": "top-kernels.csv", "profile_prefix": "profile"}, tmp_path)
    assert passed is ok and (ok or "top-kernels.csv: " in detail or "profile*" in detail), detail


def test_top_kernels_wrong_header_names_the_file_and_both_headers(tmp_path):
    (tmp_path / "top-kernels.csv").write_text(KERNELS.replace("mean_time_ms\n", "mean_ms\n"))
    (tmp_path / "profile.json").write_text("{}")
    assert check_top_kernels({"file": "top-kernels.csv", "profile_prefix": "profile"}, tmp_path) == (
        False,
        "top-kernels.csv: expected the header kernel_name,total_time_ms,instances,mean_time_ms, "
        "got kernel_name,total_time_ms,instances,mean_ms",
    )


def write_losses(path, losses):
    path.write_text("".join(json.dumps({"step": i, "loss": x}) + "\n" for i, x in enumerate(losses, 1)))


@pytest.mark.parametrize(
    ("losses", "ok"),
    [
        ([10 - 0.1 * i + 0.3 * (-1) ** i for i in range(64)], True),  # noisy but decreasing
        ([5.0] * 64, False),
        ([10 - 0.1 * i for i in range(63)], False),  # one step short
        ([10 - 0.1 * i for i in range(63)] + [math.inf], False),
    ],
)
def test_loss_curve(tmp_path, losses, ok):
    write_losses(tmp_path / "loss.jsonl", losses)
    assert check_loss_curve({"loss_file": "loss.jsonl", "steps": 64}, tmp_path)[0] is ok


def test_judge_protocol(tmp_path):
    prompt = tmp_path / "judge-prompt.md"
    prompt.write_text("RULE 1: ...")
    passing = run_judge("printf 'RULE 1: PASS ok\\nRULE 2: pass\\n'", prompt, tmp_path, 2, 30)
    assert passing == {"rules": {1: True, 2: True}, "ok": True, "error": None}
    failing = run_judge(
        "cat {prompt_file} >/dev/null; echo 'RULE 1: FAIL'; echo 'RULE 2: PASS'", prompt, tmp_path, 2, 30
    )
    assert failing["ok"] is False
    partial = run_judge("echo 'RULE 1: PASS'", prompt, tmp_path, 2, 30)
    assert partial["ok"] is None and "rules [1]" in partial["error"]


def test_attempt_diff_shows_edits_and_small_new_files_only(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "model.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "base"], check=True)
    base = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "model.py").write_text("x = 2\n")
    (tmp_path / "moba.py").write_text("def moba_attention():\n    pass\n")
    (tmp_path / "ckpt.bin").write_bytes(b"\0" * (MAX_NEW_FILE_BYTES + 1))
    (tmp_path / "ate-artifacts").mkdir()
    (tmp_path / "ate-artifacts" / "loss.jsonl").write_text("{}\n")
    diff = attempt_diff(tmp_path, base)
    assert "+x = 2" in diff and "+def moba_attention():" in diff
    assert "new file not shown, over" in diff and "ckpt.bin" in diff and "loss.jsonl" not in diff
