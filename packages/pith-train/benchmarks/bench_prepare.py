"""prepare-data's tokens/s against the `tokenizers` library's own encode_batch on the same documents.

Documents: the text files (.py, .md, .txt, .rst) of a folder (default: this Python's standard
library), one JSONL row each, cut at --mb MB. Tokenizer: a byte-level BPE of --vocab tokens trained
on them by prepare-data's own trainer (or --tokenizer). Measured, --repeats times each, interleaved,
the best kept (a shared machine's load varies): encode_batch with one thread (TOKENIZERS_PARALLELISM
off: one core's worth) and with its own thread pool over every core; prepare() end to end (reading
the JSONL, parsing, tokenizing, writing) with 1 worker and with --workers. Prints tokens/s, per
worker against encode_batch per core, and the scaling from 1 worker to --workers.
Run: uv run python packages/pith-train/benchmarks/bench_prepare.py [--mb 20] [--workers 2]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from pith_train.prepare import HFTokenizer, train_bpe

# One measurement in a fresh process: (tokens, wall seconds, CPU seconds of it and its workers).
MEASURE = """
import json, os, resource, sys, time
what, tokenizer, corpus = sys.argv[1:]
if what == "encode_batch, 1 thread":
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer
from pith_train.prepare import prepare
tok = Tokenizer.from_file(tokenizer)
docs = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")] if "encode" in what else []
cpu = lambda: sum(sum(resource.getrusage(w)[:2]) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
wall, used = time.perf_counter(), cpu()
if docs:
    n = sum(len(e.ids) + 1 for e in tok.encode_batch(docs, add_special_tokens=False))
else:
    out = os.path.join(os.path.dirname(corpus), "ds")
    n = prepare([corpus], out, tokenizer, workers=int(what.split()[1]), progress=False)["num_tokens"]
    import shutil; shutil.rmtree(out)
print(n, time.perf_counter() - wall, cpu() - used)
"""


def measure(what: str, tokenizer: str, corpus: str) -> tuple[int, float, float]:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, what, tokenizer, corpus], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[0]), float(out[1]), float(out[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--mb", type=float, default=20)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tokenizer")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    corpus, size = work / "corpus.jsonl", 0
    with open(corpus, "w", encoding="utf-8") as f:
        for p in sorted(Path(args.root).rglob("*")):
            if p.suffix in (".py", ".md", ".txt", ".rst") and p.is_file() and size < args.mb * 1e6:
                text = p.read_text(encoding="utf-8", errors="replace")
                size += len(text.encode())
                f.write(json.dumps({"text": text}) + "\n")
    tokenizer = args.tokenizer or str(work / "tokenizer.json")
    if not args.tokenizer:
        train_bpe([str(corpus)], "text", args.vocab, Path(tokenizer), progress=False)
    vocab = HFTokenizer(tokenizer).vocab_size
    print(f"{size / 1e6:.1f} MB of text, tokenizer of {vocab} tokens, {os.cpu_count()} cores")
    cores, w = os.cpu_count(), args.workers
    names = [
        "encode_batch, 1 thread",
        f"encode_batch, {cores} threads",
        "prepare, 1 worker",
        f"prepare, {w} workers",
    ]
    wall, cpu = {}, {}
    for _ in range(args.repeats):
        for name in names:
            tokens, seconds, used = measure(name, tokenizer, str(corpus))
            wall[name] = max(wall.get(name, 0), tokens / seconds)
            cpu[name] = max(cpu.get(name, 0), tokens / used)
            print(f"  {name}: {tokens:,} tokens in {seconds:.2f} s, {used:.2f} CPU s", flush=True)
    print(f"{'':32s} {'tokens/s':>12s} {'tokens/CPU s':>14s}")
    for name in names:
        print(f"{name:32s} {wall[name]:>12,.0f} {cpu[name]:>14,.0f}")
    one, many, anchor = wall[names[2]], wall[names[3]], max(wall[names[0]], wall[names[1]] / cores)
    ratios = f"{one / anchor:.2f} (1 worker), {many / w / anchor:.2f} ({w} workers)"
    print(f"per worker against encode_batch per core (wall): {ratios}")
    c1, cw, c0 = cpu[names[2]], cpu[names[3]], cpu[names[0]]
    print(f"per CPU second against encode_batch's: {c1 / c0:.2f} (1 worker), {cw / c0:.2f} ({w} workers)")
    print(f"scaling from 1 to {w} workers (wall): {many / one:.2f}x; load average {os.getloadavg()[0]:.1f}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
