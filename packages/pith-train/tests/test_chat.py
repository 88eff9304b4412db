"""Conversations for fine-tuning (pith_train.chat, `prepare-data --chat`): the chat template's rendering
and its assistant-token mask, the dataset's labels, and a chat model out of `convert`."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from pith_models import MODELS
from pith_train.chat import prepare_chat, render
from pith_train.cli import main
from pith_train.data import PackedDataset, WindowLoader
from pith_train.inference import dataset_loss
from pith_train.prepare import prepare

ROOT = Path(__file__).resolve().parents[3]


def test_the_mask_is_each_assistant_turn_end_of_turn_included(chat_tokenizer, conversations):
    tok = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    for conv in conversations(12):
        msgs = conv["messages"]
        [(ids, mask)] = render(tok, msgs)  # ChatML renders a turn alike whatever follows: one document
        assert ids == tok.apply_chat_template(msgs, return_dict=False)  # transformers' rendering
        edges = np.flatnonzero(np.diff(np.r_[0, mask, 0]))
        spans = [tok.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]
        assert spans == [m["content"] + "<|im_end|>\n" for m in msgs if m["role"] == "assistant"]


# A reasoning model's template (as Qwen3's): an assistant turn after the last user turn opens with an
# empty thinking block, earlier ones do not: turn 1 renders otherwise once turns 2 and 3 follow.
THINKING_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' and loop.index0 > ns.last %}"
    "{{ '<think></think>' }}{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_renders_earlier_turns_otherwise_gives_each_assistant_turn_its_document(
    chat_tokenizer, tmp_path
):
    """Such a template refused every conversation with two assistant turns. Each turn is now one
    document, the conversation up to it as context, as the model sees it when it answers."""
    shutil.copytree(chat_tokenizer, tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(
        json.dumps(config | {"chat_template": THINKING_TEMPLATE})
    )
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    msgs += [{"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    msgs += [{"role": "assistant", "content": "6"}, {"role": "user", "content": "thanks"}]
    docs = render(tok, msgs)
    assert [ids for ids, _ in docs] == [tok.apply_chat_template(msgs[:n], return_dict=False) for n in (3, 5)]
    for _, mask in docs:  # ones on the last turn only: its thinking block, answer and end of turn
        n = int(mask.sum())
        assert mask.dtype == np.uint8 and set(mask[:-n]) == {0} and set(mask[-n:]) == {1}
    assert [tok.decode(ids[-int(np.sum(m)) :]) for ids, m in docs] == [
        "<think></think>4<|im_end|>\n",
        "<think></think>6<|im_end|>\n",
    ]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": msgs}) + "\n")
    meta = prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "d"), str(tmp_path / "tok"), 4097, False)
    ds = PackedDataset(str(tmp_path / "d"))
    assert meta["num_docs"] == 2 and list(ds.doc_ends) == np.cumsum([len(i) for i, _ in docs]).tolist()
    assert ds.tokens.tolist() == docs[0][0] + docs[1][0] and meta["assistant_tokens"] == sum(
        np.sum(m) for _, m in docs
    )
    # Cut to --max-tokens, a turn's document keeps its context: one cut before its turn trains nothing
    # and is dropped (it was kept, 0s only), one cut inside it is kept.
    n1, n2 = len(docs[0][0]), len(docs[1][0])
    for limit, kept, cut, dropped in ((n1, [n1], 0, 1), (n2 - 1, [n1, n2 - 1], 1, 0)):
        meta = prepare_chat(
            [str(tmp_path / "c.jsonl")], str(tmp_path / f"{limit}"), str(tmp_path / "tok"), limit, False
        )
        assert (meta["num_tokens"], meta["num_docs"], meta["truncated"], meta["dropped"]) == (
            sum(kept),
            len(kept),
            cut,
            dropped,
        )


def test_prepare_data_chat_counts_truncated_and_dropped_conversations(
    chat_tokenizer, conversations, tmp_path, capsys
):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(20)))
    tok = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    lengths = [len(render(tok, c["messages"])[0][0]) for c in conversations(20)]
    limit = sorted(lengths)[10]
    longer = sum(n > limit for n in lengths)
    for how in ("truncate", "drop"):
        out = tmp_path / how
        args = ["prepare-data", str(tmp_path / "c.jsonl"), "--out", str(out), "--chat"]
        main([*args, "--tokenizer", str(chat_tokenizer), "--max-tokens", str(limit), "--too-long", how])
        meta = json.loads((out / "meta.json").read_text())
        kept = [min(n, limit) for n in lengths if how == "truncate" or n <= limit]
        assert meta["num_tokens"] == sum(kept) and meta["num_docs"] == len(kept)
        assert (meta["truncated"], meta["dropped"]) == ((longer, 0) if how == "truncate" else (0, longer))
        assert f"{longer} {how[:-1] if how == 'drop' else how}" in capsys.readouterr().out.replace("ped", "")
        assert (out / "loss_mask.bin").stat().st_size == meta["num_tokens"]
    with pytest.raises(ValueError, match="bad.jsonl:2: expected"):
        (tmp_path / "bad.jsonl").write_text('{"messages": []}\n{"text": "no"}\n')
        prepare_chat([str(tmp_path / "bad.jsonl")], str(tmp_path / "bad"), str(chat_tokenizer), 99, False)


def test_labels_are_ignored_where_the_mask_is_zero(chat_data):
    ds = PackedDataset(str(chat_data))
    loader = WindowLoader(ds, 32, 3, seed=0)  # 2: the middle windows hold no assistant token
    ((inputs_BS, labels_BS),) = loader.step_batch(0, 4, 4)
    for b in range(4):
        first = loader._train_id(b) * 32
        tokens = np.asarray(ds.tokens[first : first + 33]).astype(np.int64)
        mask = np.asarray(ds.loss_mask[first + 1 : first + 33])
        assert torch.equal(inputs_BS[b], torch.from_numpy(tokens[:-1]))
        assert torch.equal(labels_BS[b], torch.from_numpy(np.where(mask == 1, tokens[1:], -100)))
    assert 0 < (labels_BS != -100).float().mean() < 0.8


@pytest.mark.parametrize(
    "line, why",
    [("{not json", r"c.jsonl:2: not valid JSON \("), ("[1, 2]", "c.jsonl:2: expected"),
     ('{"messages": ["hi"]}', "c.jsonl:2: expected"),
     ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}', "c.jsonl:2: expected"),
     ('{"messages": [{"role": "user", "content": null}]}', "c.jsonl:2: expected"),
     ('{"messages": [{"role": "user", "content": 1}]}', "c.jsonl:2: expected"),
     ('{"messages": [{"role": "assistant", "content": "hi"}]}', "c.jsonl:2: the assistant speaks first")],
)  # fmt: skip
def test_prepare_data_chat_names_the_line_a_conversation_is_wrong_on(
    chat_tokenizer, conversations, tmp_path, line, why
):
    """A line that was not JSON gave no file or line; a JSON list raised AttributeError. Content that is
    not a string was left to the template (one that prints it trained on a list's repr). A conversation
    the assistant opens has no prompt to mask (transformers renders none for no turns): its first turn's
    mask covered the prompt header."""
    good = json.dumps(conversations(1)[0])
    (tmp_path / "c.jsonl").write_text(f"{good}\n{line}\n")
    with pytest.raises(ValueError, match=why):
        prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "ds"), str(chat_tokenizer), 4097, False)


def test_prepare_data_chat_skips_blank_lines_and_builds_beside_a_trailing_slash_over_a_leftover(
    chat_tokenizer, conversations, tmp_path
):
    """A blank line was refused; `--out DIR/` built DIR/.tmp inside DIR; a leftover DIR.tmp of an
    interrupted run failed with FileExistsError."""
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(c) for c in conversations(3)) + "\n\n")
    (tmp_path / "ds.tmp").mkdir()
    meta = prepare_chat([str(tmp_path / "c.jsonl")], f"{tmp_path / 'ds'}/", str(chat_tokenizer), 4097, False)
    assert meta["num_docs"] == 3 and PackedDataset(tmp_path / "ds").meta == meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "ds"]
    (tmp_path / "ds2.tmp").mkdir()
    (tmp_path / "ds2.tmp" / "notes.txt").write_text("a user's")  # not a leftover: kept, and said
    with pytest.raises(ValueError, match="ds2.tmp is in the way and not an interrupted run's: move it"):
        prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "ds2"), str(chat_tokenizer), 4097, False)
    with pytest.raises(ValueError, match="ds2.tmp is in the way and not an interrupted run's: move it"):
        prepare([str(tmp_path / "c.jsonl")], str(tmp_path / "ds2"), progress=False)
    assert (tmp_path / "ds2.tmp" / "notes.txt").read_text() == "a user's"


def test_conversations_without_an_assistant_token_are_refused_and_eval_of_no_label_says_so(
    chat_tokenizer, conversations, tmp_path
):
    """A dataset with no assistant token was written (pretrain then stopped at a NaN loss); eval of
    windows without a label raised ZeroDivisionError."""
    users = [{"messages": [m for m in c["messages"] if m["role"] == "user"]} for c in conversations(4)]
    (tmp_path / "u.jsonl").write_text("".join(json.dumps(c) + "\n" for c in users))
    with pytest.raises(ValueError, match="no assistant token: nothing to train on"):
        prepare_chat([str(tmp_path / "u.jsonl")], str(tmp_path / "u"), str(chat_tokenizer), 4097, False)
    assert not (tmp_path / "u").exists()
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(4)))
    with pytest.raises(
        ValueError, match=r"c.jsonl: no assistant token \(4 longer than --max-tokens 5 dropped\)"
    ):
        prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "d"), str(chat_tokenizer), 5, True)
    prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "c"), str(chat_tokenizer), 4097, False)
    np.zeros_like(np.fromfile(tmp_path / "c" / "loss_mask.bin", np.uint8)).tofile(
        tmp_path / "c" / "loss_mask.bin"
    )
    from pith_models import build

    model = build(dataclasses.replace(MODELS["qwen3-moe-tiny"], vocab_size=320), "cpu", 0)
    with pytest.raises(ValueError, match="no label token"):
        dataset_loss(model, PackedDataset(tmp_path / "c"), 16, 2)


def test_a_chat_datasets_loss_mask_is_part_of_its_identity(chat_tokenizer, conversations, tmp_path):
    """loss_mask.bin removed or changed passed the resume check: the run trained on every token."""
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(4)))
    prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "c"), str(chat_tokenizer), 4097, False)
    before, mask = PackedDataset(tmp_path / "c").fingerprint(), tmp_path / "c" / "loss_mask.bin"
    (1 - np.fromfile(mask, np.uint8)).tofile(mask)
    assert PackedDataset(tmp_path / "c").fingerprint() != before
    mask.unlink()
    with pytest.raises(ValueError, match="loss_mask.bin is missing"):
        PackedDataset(tmp_path / "c")


def test_conversations_to_a_chat_model_that_transformers_loads(
    chat_tokenizer, conversations, tmp_path, capsys
):
    """The fine-tuning path end to end: conversation JSONL + a Hugging Face tokenizer directory ->
    prepare-data --chat -> pretrain from a Hugging Face model directory made by transformers -> convert
    -> transformers' AutoTokenizer.apply_chat_template and generate on the export, with no other files;
    generate --chat renders the same prompt."""
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(30)))
    main(["prepare-data", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "data"), "--chat",
          "--tokenizer", str(chat_tokenizer), "--max-tokens", "150", "--too-long", "drop"])  # fmt: skip
    assert "dropped" in capsys.readouterr().out
    config = transformers.Qwen3MoeConfig(
        vocab_size=260, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    run, released = tmp_path / "run", tmp_path / "released"  # a released directory: tokenizer, generation
    shutil.copytree(chat_tokenizer, released)
    (released / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [258, 256], "pad_token_id": 256})
    )
    sft = str(ROOT / "configs" / "sft-qwen3-30b-a3b-8gpu.toml")
    main(["pretrain", sft, f"--model.name={tmp_path / 'base'}",
          f"--data.path={tmp_path / 'data'}", f"--data.tokenizer={released / 'tokenizer.json'}",
          "--data.seq_len=32", "--data.val_windows=2", "--train.steps=2", "--train.global_batch=4",
          "--train.micro_batch=2", "--train.device=cpu", "--train.compile=false", "--train.ac=none",
          "--parallel.dp=1", "--parallel.ep=1", "--checkpoint.every=2", "--log.progress=false",
          "--log.tensorboard=false", "--run-dir", str(run)])  # fmt: skip
    ckpt, export = run / "checkpoints" / "step_000002", tmp_path / "export"
    main(["convert", str(ckpt), str(export)])
    tok = transformers.AutoTokenizer.from_pretrained(export)
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    # generate stops where the tokenizer directory's generation config says (it was dropped: no stop)
    assert [model.generation_config.eos_token_id, model.generation_config.pad_token_id] == [[258, 256], 256]
    chat = [{"role": "user", "content": "the router"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert (
        tok.decode(ids["input_ids"][0]) == "<|im_start|>user\nthe router<|im_end|>\n<|im_start|>assistant\n"
    )
    assert out.shape[1] > ids["input_ids"].shape[1] and tok.eos_token == "<|im_end|>"
    capsys.readouterr()
    main(
        [
            "generate",
            str(ckpt),
            "--chat",
            "--prompt",
            "the router",
            "--max-new-tokens",
            "4",
            "--device",
            "cpu",
        ]
    )
    assert capsys.readouterr().out.strip() == tok.decode(out[0, ids["input_ids"].shape[1] :]).strip()


def test_a_global_batch_without_an_assistant_token_trains_on_with_a_loss_of_zero(
    chat_tokenizer, conversations, tmp_path
):
    """Its cross-entropy was 0/0: training stopped with "loss is nan", on data prepare-data accepts (any
    assistant token anywhere), and a resume met the same batch again."""
    from pith_train.config import load_config
    from pith_train.metrics import read_metrics
    from pith_train.train import pretrain

    users = [{"messages": [m for m in c["messages"] if m["role"] == "user"]} for c in conversations(40)]
    rows = [*users[:20], conversations(1)[0], *users[20:]]  # the one held-out window: the middle one
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in rows))
    prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "c"), str(chat_tokenizer), 4097, False)
    args = [f"--data.path={tmp_path / 'c'}", f"--data.tokenizer={chat_tokenizer / 'tokenizer.json'}"]
    args += ["--model.vocab_size=320", "--data.seq_len=16", "--train.global_batch=2", "--train.micro_batch=1"]
    args += ["--train.steps=4", "--optim.warmup_steps=1", "--data.val_windows=1", "--train.device=cpu"]
    pretrain(load_config(None, [*args, "--log.progress=false", "--log.tensorboard=false"]), tmp_path / "run")
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 4 and 0.0 in losses and all(np.isfinite(losses)), losses


def test_validation_windows_without_an_assistant_token_are_refused_before_training(chat_data, tmp_path):
    """Held-out windows that hold no assistant token made every val_loss NaN (0 / 0), run after run."""
    ds_dir = tmp_path / "data"
    shutil.copytree(chat_data, ds_dir)
    mask = np.fromfile(ds_dir / "loss_mask.bin", np.uint8)
    loader = WindowLoader(PackedDataset(str(ds_dir)), 32, 4, seed=0)
    for i in loader.val_ids:  # the labels of window i: tokens i*32+1 .. (i+1)*32
        mask[i * 32 + 1 : (i + 1) * 32 + 1] = 0
    mask.tofile(ds_dir / "loss_mask.bin")
    with pytest.raises(ValueError, match=r"the 4 validation windows of .*data hold no assistant token"):
        WindowLoader(PackedDataset(str(ds_dir)), 32, 4, seed=0)
    WindowLoader(PackedDataset(str(ds_dir)), 32, 3, seed=0)  # others hold some


def test_validation_windows_whose_assistant_tokens_all_start_documents_are_refused_under_the_mask(
    chat_data, tmp_path
):
    """Under data.document_mask a label that starts a document is ignored too: held-out windows whose
    only assistant tokens start documents passed the check, and every val_loss was 0 / 0."""
    ds_dir = tmp_path / "data"
    shutil.copytree(chat_data, ds_dir)
    mask, ds = np.fromfile(ds_dir / "loss_mask.bin", np.uint8), PackedDataset(str(ds_dir))
    val_ids = WindowLoader(ds, 32, 8, seed=0, docs=True).val_ids
    for i in val_ids:  # the labels of window i: tokens i*32+1 .. (i+1)*32; kept where a document starts
        g = np.arange(i * 32 + 1, (i + 1) * 32 + 1)
        mask[g] = np.isin(g, ds.doc_ends)
    assert mask[np.concatenate([np.arange(i * 32 + 1, (i + 1) * 32 + 1) for i in val_ids])].any()
    mask.tofile(ds_dir / "loss_mask.bin")
    WindowLoader(PackedDataset(str(ds_dir)), 32, 8, seed=0)  # without the mask they count
    with pytest.raises(ValueError, match=r"the 8 validation windows of .*data hold no assistant token"):
        WindowLoader(PackedDataset(str(ds_dir)), 32, 8, seed=0, docs=True)


def test_prepare_data_chat_reads_compressed_conversations_and_names_a_file_it_cannot(
    chat_tokenizer, conversations, tmp_path
):
    """A .jsonl.gz or .jsonl.zst (which prepare-data finds in a directory) failed with UnicodeDecodeError
    naming no file; so did a Parquet file, now not JSON at its line 1."""
    import gzip

    import zstandard

    text = "".join(json.dumps(c) + "\n" for c in conversations(5)).encode()
    (tmp_path / "c.jsonl").write_bytes(text)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(text))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(text))
    for name in ("c.jsonl", "c.jsonl.gz", "c.jsonl.zst"):
        prepare_chat(
            [str(tmp_path / name)], str(tmp_path / name.replace(".", "_")), str(chat_tokenizer), 4097, False
        )
    for bin in ("tokens.bin", "loss_mask.bin", "doc_ends.bin"):
        data = {(tmp_path / n / bin).read_bytes() for n in ("c_jsonl", "c_jsonl_gz", "c_jsonl_zst")}
        assert len(data) == 1, bin
    # A line separator (U+2028) inside a JSON string is one line; invalid UTF-8 is refused, not replaced
    conv = {"messages": [{"role": "user", "content": "a\u2028b"}, {"role": "assistant", "content": "c"}]}
    (tmp_path / "s.jsonl").write_text(json.dumps(conv, ensure_ascii=False) + "\n", "utf-8")
    meta = prepare_chat([str(tmp_path / "s.jsonl")], str(tmp_path / "s"), str(chat_tokenizer), 99, False)
    assert meta["num_docs"] == 1
    bad = json.dumps(conv).replace("\\u2028", "\xff").encode("latin-1")  # "a\xffb": not UTF-8
    (tmp_path / "u.jsonl").write_bytes(text.split(b"\n")[0] + b"\n" + bad + b"\n")
    with pytest.raises(ValueError, match=r"u.jsonl:2: not valid JSON"):
        prepare_chat([str(tmp_path / "u.jsonl")], str(tmp_path / "u"), str(chat_tokenizer), 4097, False)
    (tmp_path / "c.parquet").write_bytes(b"PAR1\x00\xff\xfe" * 9)
    with pytest.raises(ValueError, match=r"c.parquet:1: not valid JSON"):
        prepare_chat([str(tmp_path / "c.parquet")], str(tmp_path / "p"), str(chat_tokenizer), 4097, False)
