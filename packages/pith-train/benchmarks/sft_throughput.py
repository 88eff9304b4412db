"""Fine-tuning throughput beside pretraining's, on one GPU, in one call: Qwen3-30B-A3B cut to 4 layers
(configs/bench-qwen3-4layers-1gpu.toml: 4 x 4096 tokens a step, torch.compile, no recompute) loaded
from a Hugging Face directory, trained on the same packed conversations twice: with their loss mask
(SFT: the assistant's tokens only) and without it (pretraining: every token), document-masked.

    python3 packages/pith-train/benchmarks/sft_throughput.py [--steps 40] [--out /tmp/sft_bench]

Needs transformers (prepare-data --chat renders with it). Prints the median tokens/s and MFU of the
steps after the first 10 (compilation) for each, and the fraction of tokens the SFT loss counts.
"""

import argparse
import dataclasses
import json
import random
import shutil
import statistics
import sys
from pathlib import Path

import pith_models
import torch
from pith_train.chat import prepare_chat
from pith_train.config import load_config
from pith_train.train import pretrain

ROOT = Path(__file__).resolve().parents[3]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer_dir(path: Path) -> None:
    """Byte-level (256 bytes, no merges) and ChatML's special tokens, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, **special}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def conversations(n: int) -> str:
    rng = random.Random(0)
    words = ["the", "expert", "router", "token", "loss", "mask", "turn", "model", "layer", "window"]
    lines = []
    for _ in range(n):
        msgs = []
        for _ in range(rng.randint(1, 4)):
            for role, k in (("user", (5, 60)), ("assistant", (20, 400))):
                msgs.append({"role": role, "content": " ".join(rng.choices(words, k=rng.randint(*k)))})
        lines.append(json.dumps({"messages": msgs}))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="/tmp/sft_bench")
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU: the script's path only")
    args = p.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    tokenizer_dir(out / "tok")
    (out / "chats.jsonl").write_text(conversations(60 if args.smoke else 3000))
    meta = prepare_chat([str(out / "chats.jsonl")], str(out / "sft"), str(out / "tok"), 4097, drop=False)
    shutil.copytree(out / "sft", out / "pre")
    (out / "pre" / "loss_mask.bin").unlink()  # the same tokens, every one counted: not a chat dataset
    pre_meta = json.loads((out / "pre" / "meta.json").read_text())
    del pre_meta["assistant_tokens"]
    (out / "pre" / "meta.json").write_text(json.dumps(pre_meta))
    # The bench preset less its layer-count override: model.name is the 4-layer directory instead.
    text = (ROOT / "configs" / "bench-qwen3-4layers-1gpu.toml").read_text()
    assert "num_hidden_layers = 4\n" in text
    preset = out / "preset.toml"
    preset.write_text(text.replace("num_hidden_layers = 4\n", ""))
    name, layers = ("tiny-moe", 2) if args.smoke else ("qwen3-30b-a3b", 4)
    geometry = dataclasses.replace(pith_models.MODELS[name], num_hidden_layers=layers)
    model = pith_models.build(geometry, "cpu", seed=0)
    pith_models.save_pretrained(model, out / "hf")
    del model
    rows = {}
    for name in ("pre", "sft"):
        overrides = [
            f"--model.name={out / 'hf'}", f"--data.path={out / name}",
            f"--data.tokenizer={out / 'tok' / 'tokenizer.json'}", f"--train.steps={args.steps}",
            "--checkpoint.every=0", "--log.tensorboard=false", "--log.progress=false", "--log.eval_every=0",
            "--data.val_windows=2", "--data.document_mask=true",  # a conversation sees only itself
        ]  # fmt: skip
        if args.smoke:  # the code path on CPU in seconds
            overrides += [
                "--train.device=cpu",
                "--train.compile=false",
                "--data.seq_len=64",
                "--train.ac=none",
            ]
        cfg = load_config(str(preset), overrides)
        pretrain(cfg, out / f"run_{name}")
        metrics = [json.loads(x) for x in (out / f"run_{name}" / "metrics.jsonl").read_text().splitlines()]
        rows[name] = [m for m in metrics if "tokens_per_s" in m][2 if args.smoke else 10 :]
        shutil.rmtree(out / f"run_{name}" / "checkpoints")  # fp32 weights and AdamW state: 37 GB
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{device}; assistant tokens {meta['assistant_tokens'] / meta['num_tokens']:.1%}")
    for name, what in (("pre", "pretraining (every token)"), ("sft", "SFT (loss mask)")):
        tps = statistics.median(m["tokens_per_s"] for m in rows[name])
        mfu = [m["mfu"] for m in rows[name] if "mfu" in m]  # on CUDA only
        mfu = f", MFU {statistics.median(mfu):.1%}" if mfu else ""
        print(f"{what:28s} {tps:,.0f} tokens/s{mfu}, final loss {rows[name][-1]['loss']:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
