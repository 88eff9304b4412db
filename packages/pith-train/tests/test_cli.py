import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pith_models
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pith_train.cli import main
from pith_train.data import PackedDataset, WindowLoader, windows
from pith_train.inference import top_p_keep
from pith_train.prepare import ByteTokenizer, HFTokenizer, stdlib_corpus
from pith_train.train import build_model, pretrain
from safetensors.torch import load_file


def test_convert_hf_to_pith_to_hf_gives_identical_tensors(micro_hf, tmp_path, capsys):
    main(["convert", str(micro_hf), str(tmp_path / "pith")])
    main(["convert", str(tmp_path / "pith"), str(tmp_path / "hf"), "--dtype", "float32"])
    before, after = (
        load_file(micro_hf / "model.safetensors"),
        load_file(tmp_path / "hf" / "model.safetensors"),
    )
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3_moe"
    # A converted checkpoint is a model.name training can start from.
    ours = build_model(str(tmp_path / "pith"), torch.device("cpu"), seed=1).state_dict()
    ref = pith_models.from_pretrained(micro_hf).state_dict()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    with pytest.raises(SystemExit):
        main(["convert", str(tmp_path / "pith"), str(tmp_path / "hf")])  # destination exists
    assert "already exists" in capsys.readouterr().err
    mine = tmp_path / "hf2.tmp"  # a user's directory that happens to have DST.tmp's name stays
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit):
        main(["convert", str(tmp_path / "pith"), str(tmp_path / "hf2")])
    assert "hf2.tmp" in capsys.readouterr().err and (mine / "notes.txt").read_text() == "keep"
    assert not (tmp_path / "hf2").exists()


@pytest.mark.parametrize("full", [False, True])
def test_plot_writes_a_png_with_a_panel_per_metric(tmp_path, monkeypatch, capsys, full):
    import matplotlib.figure

    rows = [{"step": s, "loss": 5 - s, "tokens_per_s": 100 + s} for s in range(1, 4)]
    if full:  # what the trainer writes
        rows = [
            {**r, "lr": 0.1 * r["step"], "grad_norm": 1.0, "expert_load_max_over_mean": [1.5, 2.0]}
            for r in rows
        ]
    rows[-1]["val_loss"] = 2.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    labels = []
    real_savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure,
        "savefig",
        lambda fig, *a, **k: labels.extend(ax.get_ylabel() for ax in fig.axes) or real_savefig(fig, *a, **k),
    )
    main(["plot", str(tmp_path)])  # the cut-off last line (a killed write) is skipped
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    more = ["lr", "grad_norm", "expert load max/mean"] if full else []
    assert labels == ["loss", "tokens / s", *more]
    # --out without an extension: matplotlib adds .png, and the path printed is the one written
    capsys.readouterr()
    main(["plot", str(tmp_path), "--out", str(tmp_path / "curves")])
    main(["schedule", "--pp", "2", "--micro-batches", "4", "--png", str(tmp_path / "s")])
    wrote = [line[6:] for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert len(wrote) == 2 and all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in wrote), wrote


def test_schedule_prints_every_rank_and_draws_a_png(tmp_path, capsys):
    main(["schedule", "--pp", "2", "--micro-batches", "4", "--png", str(tmp_path / "s.png")])
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("rank 0: F0.0 >r1:F0.0 F0.1") and out[2].startswith("rank 1: <r0:F0.0 F1.0")
    assert "[F0.3+B3.1]" in out[1]  # an overlapped pair
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        main(["schedule", "--pp", "4", "--micro-batches", "7"])
    assert "at least 2*pp = 8 micro-batches per step, got 7" in capsys.readouterr().err


def test_cli_reports_bad_overrides_and_prints_config(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["pretrain", "--run-dir", str(tmp_path), "--train.nope=1"])
    assert e.value.code == 1 and "unknown key train.nope" in capsys.readouterr().err
    main(["pretrain", "--print-config", "--train.steps", "7"])
    assert "steps = 7" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())


# The default run (`pith-train pretrain`, as a new user types it): 120 steps, ~45 s on one CPU core. Its
# experts start collapsed (max/mean load 3.9 of 4 at step 1) and end balanced; cut to 60 steps (a
# schedule of its own) the bound held by too little (2.06 in one layer once the held-out windows moved).
DEFAULT_STEPS = 120


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, subprocess_env):
    """`python -m pith_train pretrain`, nothing changed: (run directory, stdout)."""
    run = tmp_path_factory.mktemp("default") / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pith_train",
            "pretrain",
            "--run-dir",
            str(run),
        ],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stdout


def test_default_command_trains_tiny_moe_on_the_builtin_corpus(default_run):
    """It prepares the corpus, trains, saves."""
    run, stdout = default_run
    assert f"run directory  {run}" in stdout and "checkpoints" in stdout
    meta = json.loads((run / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["num_files"] > 100
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, DEFAULT_STEPS + 1)) and "val_loss" in rows[-1]
    assert {"loss", "lr", "tokens_per_s", "grad_norm", "aux", "expert_load_max_over_mean"} <= set(rows[0])
    assert (run / "checkpoints" / f"step_{DEFAULT_STEPS:06d}" / ".metadata").is_file()
    assert 'name = "tiny-moe"' in (run / "config.toml").read_text()


def test_default_run_ends_with_every_moe_layer_balanced(default_run):
    """Final max/mean expert load <= 2 in each of tiny-moe's 4 MoE layers (8 experts, top-2: at most 4)."""
    load = json.loads((default_run[0] / "metrics.jsonl").read_text().splitlines()[-1])[
        "expert_load_max_over_mean"
    ]
    assert len(load) == 4 and max(load) <= 2.0, load


def test_default_run_exports_to_hugging_face_exactly(default_run, tmp_path, capsys):
    """The fp32 export gives the checkpoint's logits and, under `eval`, its loss."""
    run = default_run[0]
    ckpt, hf = run / "checkpoints" / f"step_{DEFAULT_STEPS:06d}", tmp_path / "hf"
    main(["convert", str(ckpt), str(hf), "--dtype", "float32"])
    convert_out = capsys.readouterr().out
    tokens = torch.from_numpy(PackedDataset(str(run / "data")).tokens[: 4 * 128].astype(np.int64)).view(
        4, 128
    )
    with torch.no_grad():
        want = build_model(str(ckpt), torch.device("cpu"), seed=0).reference_forward(tokens)
        got = pith_models.from_pretrained(hf).reference_forward(tokens)
    assert want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    losses = []
    for model, extra in ((ckpt, []), (hf, ["--tokenizer", "byte", "--seq-len", "128"])):
        main(["eval", str(model), "--data", str(run / "data"), "--max-windows", "8", *extra])
        losses.append(capsys.readouterr().out.split()[1])
    assert losses[0] == losses[1] and "routing bias" not in convert_out


@pytest.fixture(scope="module")
def trained(micro_config, tmp_path_factory):
    """A 3-step micro run with the routing bias on (micro_args' train.bias_rate): it is nonzero."""
    from pith_train.train import pretrain

    run = tmp_path_factory.mktemp("trained")
    pretrain(micro_config("--train.steps=3"), run)
    return run / "checkpoints" / "step_000003"


def test_pretrain_refuses_a_run_directory_in_a_checkpoint_or_a_dataset_and_changes_nothing(
    trained, byte_data, micro_args, tmp_path, capsys
):
    """A run directory inside a checkpoint trained, and its config.toml overwrote the checkpoint's:
    the run it came from found its only checkpoint damaged. One in a dataset or a run's checkpoints/
    mixed run files into it."""
    ckpt, data = tmp_path / "run" / "checkpoints" / "step_000003", tmp_path / "data"
    shutil.copytree(trained, ckpt)
    shutil.copytree(byte_data, data)
    before = {p: p.is_file() and p.read_bytes() for p in tmp_path.rglob("*")}  # directories too
    for run_dir in (ckpt, ckpt / "new", ckpt.parent, data, data / "new"):
        with pytest.raises(SystemExit) as e:
            main(["pretrain", *micro_args, "--train.steps=1", "--run-dir", str(run_dir)])
        err = capsys.readouterr().err
        assert e.value.code == 1 and f"--run-dir {run_dir} is in a checkpoint, a dataset or" in err, err
    assert {p: p.is_file() and p.read_bytes() for p in tmp_path.rglob("*")} == before
    shutil.copytree(trained, tmp_path / "work" / "converted")  # a checkpoint beside a run is fine
    main(
        [
            "pretrain",
            *micro_args,
            "--train.steps=1",
            "--checkpoint.every=0",
            "--run-dir",
            str(tmp_path / "work"),
        ]
    )


def test_convert_of_a_run_with_routing_bias_exports_with_a_note_or_refuses(trained, tmp_path, capsys):
    model = build_model(str(trained), torch.device("cpu"), seed=0)
    assert any(b.any() for n, b in model.named_buffers() if n.endswith("expert_bias"))
    with pytest.raises(SystemExit):
        main(["convert", str(trained), str(tmp_path / "hf"), "--refuse-routing-bias"])
    assert "nonzero routing bias" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()  # a retry is not blocked
    main(["convert", str(trained), str(tmp_path / "hf"), "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "note: 2 MoE layers have a nonzero routing bias" in out and "routes without it" in out
    assert "need --tokenizer" not in out  # the run's config.toml went along, naming the byte tokenizer
    exported = pith_models.from_pretrained(tmp_path / "hf")
    for name, p in exported.state_dict().items():  # everything but the routing bias, exactly
        want = torch.zeros_like(p) if name.endswith("expert_bias") else model.state_dict()[name]
        assert torch.equal(p, want), name


def test_convert_carries_the_tokenizer_and_the_run_config_both_ways(micro_hf, tmp_path):
    hf = tmp_path / "hf_in"
    shutil.copytree(micro_hf, hf)
    carried = {"tokenizer.json": '{"version": "1.0"}', "config.toml": "[data]\nseq_len = 48\n"}
    for name, text in carried.items():
        (hf / name).write_text(text)
    main(["convert", str(hf), str(tmp_path / "pith")])
    main(["convert", str(tmp_path / "pith"), str(tmp_path / "hf_out")])
    for name, text in carried.items():
        assert (tmp_path / "pith" / name).read_text() == (tmp_path / "hf_out" / name).read_text() == text


def test_eval_and_generate_on_an_exported_byte_run_need_no_tokenizer_or_seq_len(
    trained, byte_data, tmp_path, capsys
):
    """The export carries the run's config.toml: the byte tokenizer and data.seq_len (32) come from it."""
    main(["convert", str(trained), str(tmp_path / "hf"), "--dtype", "float32"])
    main(["eval", str(tmp_path / "hf"), "--data", str(byte_data), "--max-windows", "5"])
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith("loss ") and "(160 tokens of" in out and "windows of 32)" in out
    main(["generate", str(tmp_path / "hf"), "--prompt", "def ", "--max-new-tokens", "3"])
    assert capsys.readouterr().out.startswith("def ")


def test_eval_reports_the_reference_loss_of_every_window(trained, byte_data, capsys):
    main(["eval", str(trained), "--data", str(byte_data), "--batch", "3", "--max-windows", "7"])
    out, err = capsys.readouterr()
    assert err.splitlines() == [  # not a terminal: progress lines, each a tenth of the windows or more
        f"{n}/7 windows, loss so far {float(line.split()[-1]):.4f}"
        for n, line in zip((3, 6, 7), err.splitlines(), strict=True)
    ]
    loss, perplexity = float(out.split()[1]), float(out.split()[3])
    assert (
        perplexity == pytest.approx(math.exp(loss), rel=1e-4)
        and "(224 tokens of" in out
        and "windows of 32" in out
    )
    model = build_model(str(trained), torch.device("cpu"), seed=0).double()
    tokens = torch.from_numpy(PackedDataset(str(byte_data)).tokens[: 7 * 32 + 1].astype(np.int64))
    inputs, labels = tokens[:-1].view(7, 32), tokens[1:].view(7, 32)
    want = torch.nn.functional.cross_entropy(model.reference_forward(inputs).flatten(0, 1), labels.flatten())
    assert loss == pytest.approx(float(want), abs=1e-4)  # printed to 4 decimals


def test_generate_greedy_continues_with_the_argmax_token_each_time(trained, capsys):
    main(["generate", str(trained), "--prompt", "def ", "--max-new-tokens", "5"])
    text = capsys.readouterr().out.rstrip("\n")
    model = build_model(str(trained), torch.device("cpu"), seed=0).double()
    ids = list(b"def ")
    for _ in range(5):
        ids.append(int(model.reference_forward(torch.tensor([ids]))[0, -1, :257].argmax()))
    assert text == ByteTokenizer().decode(ids)
    main(
        [
            "generate",
            str(trained),
            "--prompt",
            "def ",
            "--max-new-tokens",
            "5",
            "--top-p",
            "0.9",
            "--seed",
            "3",
        ]
    )
    sampled = capsys.readouterr().out.rstrip("\n")
    assert sampled.startswith("def ")
    main(
        [
            "generate",
            str(trained),
            "--prompt",
            "def ",
            "--max-new-tokens",
            "5",
            "--top-p",
            "0.9",
            "--seed",
            "3",
        ]
    )
    assert capsys.readouterr().out.rstrip("\n") == sampled  # seeded


@settings(max_examples=50)
@given(
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=12).filter(lambda w: sum(w) > 0),
    st.floats(0.01, 1.0),
)
def test_top_p_keeps_the_fewest_most_probable_tokens_reaching_p(weights, top_p):
    probs64 = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    keep = top_p_keep(probs64.float(), top_p)
    kept, dropped = probs64[keep], probs64[~keep]
    assert kept.sum() >= top_p - 1e-6 or keep.all()
    assert not len(dropped) or kept.min() >= dropped.max() - 1e-7  # the most probable ones
    assert kept.sum() - kept.min() < top_p + 1e-6  # none of them could be left out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["eval", "{tmp}", "--data", "{data}", "--tokenizer", "byte", "--seq-len", "32"],
            "a model directory needs a config.json",
        ),
        (
            ["eval", "{hf}", "--data", "{data}", "--tokenizer", "byte"],
            "has no run config (config.toml) giving the window length: pass --seq-len",
        ),
        (["eval", "{ckpt}", "--data", "{data}", "--cpu-threads", "-1"], "--cpu-threads must be >= 0"),
        (["eval", "{ckpt}", "--data", "{data}", "--seq-len", "60000"], "not one window of --seq-len 60000"),
        (["generate", "{ckpt}", "--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["generate", "{hf}", "--prompt", "x"], "no tokenizer.json and no run config"),
        (["generate", "{tmp}", "--prompt", "x"], "a model directory needs a config.json"),  # not --tokenizer
        (["eval", "{damaged}", "--data", "{data}", "--tokenizer", "byte"], "is damaged: manifest.json"),
        (["eval", "{tmp}/nope", "--data", "{data}"], "nope does not exist"),
        (["eval", "{ckpt}", "--data", "{bad}"], "holds token id 300, more than the model's 260"),
        (["eval", "{tmp}/nope", "--data", "{data}", "--tokenizer", "byte"], "nope does not exist"),
        (["generate", "{tmp}/nope", "--prompt", "x"], "nope does not exist"),
        (["eval", "{ckpt}", "--data", "{data}", "--batch", "0"], "--batch must be >= 1, got 0"),
        (["eval", "{ckpt}", "--data", "{data}", "--max-windows", "-1"], "--max-windows must be >= 0, got -1"),
        (["eval", "{ckpt}", "--data", "{data}", "--seq-len", "0"], "--seq-len must be >= 1, got 0"),
        (["generate", "{ckpt}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["schedule", "--pp", "0", "--micro-batches", "4"], "--pp must be >= 1, got 0"),
        (["check-layout", "--nproc", "2"], "--nproc 2: the layout pp*dp*cp*ep is 1; give --nproc 1 or"),
        (["check-layout", "--nproc", "1", "--steps", "0"], "--steps must be >= 1, got 0"),
        (
            ["check-layout", "--nproc", "2", "--parallel.pp=2"],
            "DualPipeV needs at least 2*pp = 4 micro-batches",
        ),
        (
            ["generate", "{ckpt}", "--prompt", "x", "--tokenizer", "{chat}"],
            "trained with (byte): leave --tokenizer",
        ),
        (
            ["eval", "{ckpt}", "--data", "{data}", "--tokenizer", "{chat}"],
            "trained with (byte): leave --tokenizer",
        ),
        (["plan", "--gpu-memory", "nan"], "--gpu-memory nan: expected the GiB of one card"),
        (["plan", "--gpu-memory", "inf"], "--gpu-memory inf: expected the GiB of one card"),
        (
            ["prepare-data", "{tmp}", "--chat", "--out", "{tmp}/x", "--max-tokens", "0"],
            "--max-tokens must be >= 1",
        ),
        (["eval", "{run}", "--data", "{data}"], "a run directory; name a checkpoint, e.g."),
        (["generate", "{run}", "--prompt", "x"], "/checkpoints/step_000003"),
        (["generate", "{ckpt}", "--prompt", "x", "--temperature", "2"], "--temperature and --seed sample"),
        (["generate", "{ckpt}", "--prompt", "x", "--seed", "3"], "--seed sample: add --top-p"),
        (["generate", "{ckpt}", "--prompt", "x", "--top-p", ".5", "--temperature", "0"], "--temperature > 0"),
        (["check-layout", "--nproc", "1", "--rtol", "-1"], "--rtol must be >= 0, got -1.0"),
        (["check-layout", "--nproc", "1", "--rtol", "nan"], "--rtol must be >= 0, got nan"),
        (["bench", "--tiny", "--json", "{tmp}/nope/b.json"], "/nope/b.json: not a file in a directory"),
        (["bench", "--tiny", "--json", "{tmp}"], ": not a file in a directory"),
        (["bench", "--tiny", "--device", "cpu", "--cuda-graph"], "train.cuda_graph needs a CUDA device"),
        (["plan", "--gpus", "4", "--parallel.dp=2"], "--gpus sets parallel.dp: give one of them"),
        (["plan", "--rank", "1"], "--rank and --steps are for --measure: add it"),
        (["plan", "--steps", "3"], "--rank and --steps are for --measure: add it"),
        (["schedule", "--pp", "2", "--micro-batches", "3"], "got 3 (raise --micro-batches)"),
    ],
)
def test_inference_commands_fail_with_one_line(
    trained, byte_data, bad_data, micro_hf, chat_tokenizer, tmp_path, capsys, argv, message
):
    damaged = tmp_path / "damaged"
    shutil.copytree(trained, damaged)
    (damaged / "manifest.json").unlink()
    names = {"tmp": tmp_path, "ckpt": trained, "damaged": damaged, "data": byte_data, "hf": micro_hf}
    names |= {"bad": bad_data, "chat": chat_tokenizer, "run": trained.parent.parent}
    with pytest.raises(SystemExit) as e:
        main([a.format(**names) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 1 and message in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_a_run_directory_given_as_a_checkpoint_is_refused_naming_its_latest_intact_one(
    trained, byte_data, chat_tokenizer, tmp_path, capsys
):
    """Of a run whose tokenizer is a Hugging Face one (no tokenizer.json in the run directory, only in its
    checkpoints), with a damaged newer checkpoint beside the intact one: eval and generate named the
    damaged one, or asked for --tokenizer."""
    run = tmp_path / "run"
    shutil.copytree(trained.parent.parent, run)
    (run / "checkpoints" / "step_000009.damaged").mkdir()
    config = (run / "config.toml").read_text().replace('"byte"', f'"{chat_tokenizer}/tokenizer.json"')
    (run / "config.toml").write_text(config)
    for argv in (["eval", str(run), "--data", str(byte_data)], ["generate", str(run), "--prompt", "x"]):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert f"a run directory; name a checkpoint, e.g. {run}/checkpoints/step_000003\n" in err, err


def test_prepare_data_trains_a_bpe_tokenizer_that_round_trips_and_a_model_trains_on_it(
    micro_config, micro_hf, tmp_path, capsys
):
    """--train-tokenizer 300 on three standard-library files and .jsonl rows: every document decodes
    back to its text; a micro model of 320 rows trains on it, validated on a second dataset
    (data.val_path) made with that tokenizer, whose logged validation loss is the float64 reference
    loss of the spread validation windows."""
    docs = ["héllo wörld ☃", "  two  spaces\tand a tab\n", "<|endoftext|> as text", ""]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs) + "\n")
    files = [*stdlib_corpus()[:3], str(tmp_path / "rows.jsonl")]
    train_ds, val_ds = tmp_path / "train", tmp_path / "val"
    for bad, message in (
        ("--tokenizer=byte", "not allowed with argument"),
        ("--workers=1", "257: 256 bytes, EOS and one merge need 258 or more"),
    ):
        with pytest.raises(SystemExit):
            main(["prepare-data", *files, "--out", str(train_ds), "--train-tokenizer", "257", bad])
        assert message in capsys.readouterr().err and not train_ds.exists()
    main(["prepare-data", *files, "--out", str(train_ds), "--train-tokenizer", "300", "--workers", "2"])
    tokenizer = train_ds / "tokenizer.json"
    assert f"--data.tokenizer={tokenizer} --model.vocab_size=320" in capsys.readouterr().out
    tok, ds = HFTokenizer(str(tokenizer)), PackedDataset(str(train_ds))
    meta = ds.meta
    assert meta["tokenizer"] == str(tokenizer) and meta["tokenizer_hash"] == tok.hash
    assert meta["vocab_size"] == tok.vocab_size == 300 and tok.eos_id == tok.tok.token_to_id("<|endoftext|>")
    texts = [Path(f).read_text(encoding="utf-8") for f in files[:3]] + docs
    starts = np.concatenate([[0], ds.doc_ends[:-1]])
    assert len(starts) == len(texts)
    for text, start, end in zip(texts, starts, ds.doc_ends):
        ids = ds.tokens[start:end].tolist()
        assert ids[-1] == tok.eos_id and tok.decode(ids[:-1]) == text
    assert len(ds.tokens) < 0.75 * sum(len(t.encode()) for t in texts)  # 43 merges shorten the text (0.71)
    main(["prepare-data", stdlib_corpus()[3], "--out", str(val_ds), "--tokenizer", str(train_ds)])  # its dir
    hf = tmp_path / "micro320"
    micro = dataclasses.replace(pith_models.from_pretrained(micro_hf).cfg, vocab_size=320)
    pith_models.save_pretrained(pith_models.build(micro, "cpu"), hf)
    run = tmp_path / "run"
    cfg = micro_config(
        f"--model.name={hf}", f"--data.path={train_ds}", f"--data.tokenizer={train_ds}",
        f"--data.val_path={val_ds}", "--train.steps=4",
    )  # fmt: skip
    out = pretrain(cfg, run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] and out["val_loss"] == rows[-1]["val_loss"]
    assert (Path(out["checkpoints"]) / "step_000004" / "tokenizer.json").read_text() == tokenizer.read_text()
    model = build_model(f"{out['checkpoints']}/step_000004", torch.device("cpu"), seed=0).double()
    val = PackedDataset(str(val_ds))
    inputs, labels = windows(val.tokens, 32, WindowLoader(ds, 32, 4, 0, val).val_ids)
    with torch.no_grad():
        logits = model.reference_forward(inputs)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert out["val_loss"] == pytest.approx(float(want), rel=1e-4)


def test_a_refusal_under_nproc_per_node_is_printed_once_and_every_rank_exits(
    micro_args, tmp_path, subprocess_env
):
    args = [*micro_args, "--parallel.dp=2", "--train.micro_batch=1", f"--data.path={tmp_path}/missing"]
    argv = [sys.executable, "-m", "pith_train", "pretrain", "--nproc-per-node", "2", *args]
    out = subprocess.run([*argv, "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                         env=subprocess_env, timeout=300)  # fmt: skip
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert out.returncode == 1 and len(errors) == 1, out.stderr
    assert errors[0] == f"pith-train pretrain: error: data.path '{tmp_path}/missing' does not exist"


def test_ctrl_c_in_check_layouts_one_process_run_says_interrupted_with_no_traceback(monkeypatch, capsys):
    """pretrain's Interrupted (raised after it saved) escaped `main` as a traceback naming a checkpoint in
    check-layout's temporary directory, already removed."""
    import pith_train.layoutcheck as layoutcheck
    from pith_train.cli import main
    from pith_train.stopping import Interrupted

    def interrupted(cfg, run_dir):
        raise Interrupted(2, 3, run_dir)

    monkeypatch.setattr(layoutcheck, "pretrain", interrupted)
    with pytest.raises(SystemExit) as e:
        main(["check-layout", "--nproc", "2", "--parallel.dp=2", "--train.micro_batch=4"])
    assert e.value.code == 130 and capsys.readouterr().err == "pith-train check-layout: interrupted\n"
