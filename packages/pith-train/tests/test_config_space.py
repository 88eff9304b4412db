"""The trainer's config space, drawn: hypothesis draws `pith-train pretrain` configurations from the
valid space (model family; aux losses on or off: load balancing, z-loss, the routing bias; 1-4
micro-batches; activation checkpointing none/selective/full; overlap and the weight-gradient delay on
or off; FP8 on the CPU path; validation windows that need not fill a batch; AdamW or Muon; document
masking, on a dataset of short documents; a blend of 1-3 sources with drawn weights; layouts of 1, 2
and 4 processes over pp, dp, cp, ep and their products) and checks, for each:
- it trains, validation included, without an error;
- its per-step losses, gradient norms, aux losses and validation losses equal the plain run of the
  same config: one process, each micro-batch whole (the same sequences, data layout contract), and
  the step's micro-batches one where the math does not depend on their count (all but the
  global-batch load balancing, whose f_e * P_e is taken per micro-batch), no recompute, overlap or
  delay, Adam eps 1e-3 as check-layout compares; to the tolerances of RTOL, measured;
- stopped at a drawn step and resumed, it equals the uninterrupted run bit for bit;
- every rank runs each of its layers' attention once per micro-batch and validation batch, twice
  under ac=full (one recompute): counted by a forward hook.
So a loss, gradient or metric scaled by (or not reduced over) the micro-batches, data, expert,
pipeline or context ranks shows (benchmarks/mutants.py checks it). The multi-process draws train
every aux term (their reductions over ranks are what a layout changes). A new trainer option joins
the draw in the commit that adds it. The `ci` profile draws 6 one-process configurations and 2 of
each world size (deterministically); HYPOTHESIS_PROFILE=dev 16 times more.
"""

import dataclasses
import json
import math
import os
import random
import tempfile
from pathlib import Path

import pith_models
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pith_engine.schedule import rank_chunks, split_layers
from pith_models import deepseek_v2, gpt_oss
from pith_train.config import load_config
from pith_train.prepare import prepare, stdlib_corpus
from pith_train.train import pretrain

STEPS, SEQ = 3, 16
# Relative tolerances against the plain run, (step 1, later steps), the largest seen over the ci draws
# in brackets. fp32: step 1 has the same weights on both sides (8.7e-8), later steps add summation-
# order noise (2.7e-7). FP8 quantises a weight gradient's columns over the tokens of a micro-batch on
# one rank, so a split of the tokens that differs (a layout, micro-batches merged) rounds them
# otherwise: the step-1 forward (loss, aux) alike (8.7e-8), the step-1 gradient norm not (1.5e-4),
# later losses and validation losses (7.3e-4), later aux (3.5e-3: a small sum over routing that the
# weights' FP8 differences move, Qwen3 ep2 from an init checkpoint, a draw that hypothesis's constants
# from the sources brought in); later gradient norms not compared (they follow
# the weights' FP8 differences: 2.0e-2, and 0.33 at step 3 of DeepSeek-V2 under dp2 x ep2). Muon's
# Newton-Schulz in bf16 (its default) turns summation-order noise into flipped bf16 roundings
# (later: 1.2e-4, the validation loss under pp2 x ep2; test_muon: 1.6e-5).
RTOL = {"fp32": (1e-6, 1e-5), "fp8": (1e-6, 2e-3), "fp8 grad_norm": (1e-3, math.inf), "fp8 aux": (1e-6, 6e-3)}
RTOL["muon"] = (1e-6, 5e-4)
FAMILIES = {  # 4 layers (2 chunks a pipeline rank of pp2), tiny widths; qwen3_moe: conftest's micro model's
    "qwen3_moe": None,
    "deepseek_v2": dataclasses.replace(deepseek_v2.TINY, num_hidden_layers=4, max_position_embeddings=64),
    "gpt_oss": dataclasses.replace(gpt_oss.TINY, num_hidden_layers=4, layer_types=()),
}
LAYOUTS = {  # world size -> (pp, dp, cp, ep)
    1: [(1, 1, 1, 1)],
    2: [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)],
    4: [(2, 1, 1, 2), (2, 2, 1, 1), (1, 2, 1, 2), (1, 1, 2, 2), (1, 1, 1, 4), (2, 1, 2, 1)],
}
# benchmarks/mutants.py pins the layouts ("pp,dp,cp,ep;...": other world sizes not run) and options.
PINNED = [tuple(map(int, x.split(","))) for x in os.environ.get("CONFIG_SPACE_LAYOUTS", "").split(";") if x]
PINNED_OPTIONS = os.environ.get("CONFIG_SPACE_OPTIONS", "").split()
AUX_ON = ["--train.lbl_coef=1e-2", "--train.z_loss_coef=1e-3", "--train.bias_rate=1e-2"]


@dataclasses.dataclass
class Drawn:
    family: str
    layout: tuple[int, int, int, int]
    micro_batches: int
    micro_batch: int
    options: list[str]  # every other override
    stop_at: int
    val_path: bool  # validation on a dataset of its own (data.val_path), not windows held out
    init: bool  # from a checkpoint of a 2-step run (checkpoint.init_from), not from the HF weights
    document_mask: bool  # data.document_mask, its first source Setup.short_docs
    weights: list[float]  # data.weights of 1-3 sources (data.path), each validated on its own

    @property
    def data_ranks(self) -> int:
        return self.layout[1] * self.layout[3]

    @property
    def merged(self) -> int:
        """Micro-batches of the draw that are one in the plain run (1: none merged; module docstring).
        Not under FP8: its weight-gradient columns are quantised per micro-batch, so merged ones round
        otherwise, and on the short documents of document masking (few labels a micro-batch) the
        validation loss moved 7.6e-3, past FP8's tolerance, with nothing wrong."""
        fp8 = _option(self, "train.fp8") == "true"
        return self.micro_batches if float(_option(self, "train.lbl_coef")) == 0 and not fp8 else 1

    def overrides(self, setup: "Setup", plain: bool = False) -> list[str]:
        pp, dp, cp, ep = (1, 1, 1, 1) if plain else self.layout
        micro = self.micro_batch * (self.data_ranks * self.merged if plain else 1)
        options = [o for o in self.options if not plain or not o.startswith(("--train.ac", "--parallel"))]
        sequences = self.micro_batches * self.micro_batch * self.data_ranks
        plainly = ["--train.ac=none", "--parallel.overlap=false", "--parallel.wgrad_delay=false"] * plain
        # documents of 1 to 12 tokens: several in every window of SEQ, some spanning the CP chunks
        first = setup.short_docs if self.document_mask else setup.data
        sources = [first, *setup.more][: len(self.weights)]
        options += [f"--data.val_path={','.join([str(setup.val_data)] * len(sources))}"] * self.val_path
        options += [f"--data.weights={','.join(map(str, self.weights))}"]
        options += [
            f"--checkpoint.init_from={setup.source(self.family, _option(self, 'optim.name'))}"
        ] * self.init
        return [
            f"--model.name={setup.hf[self.family]}", f"--data.path={','.join(map(str, sources))}",
            f"--data.seq_len={SEQ}", f"--data.document_mask={self.document_mask}".lower(),
            f"--train.steps={STEPS}", f"--train.global_batch={sequences}", f"--train.micro_batch={micro}",
            "--train.device=cpu", "--train.lr=1e-2", "--optim.eps=1e-3", "--optim.warmup_steps=1",
            "--log.progress=false", "--log.tensorboard=false",
            f"--parallel.pp={pp}", f"--parallel.dp={dp}", f"--parallel.cp={cp}", f"--parallel.ep={ep}",
            *options, *plainly,
        ]  # fmt: skip

    def attention_calls(self, rank: int, val_windows: int, eval_every: int) -> int:
        """What each rank's layers' attention must run over the uninterrupted run (module docstring)."""
        pp = self.layout[0]
        spans = split_layers(4, pp)
        held = sum(len(spans[c]) for c in rank_chunks(pp, rank // (math.prod(self.layout) // pp)))
        full = any(o == "--train.ac=full" for o in self.options)
        evals = len({s for s in range(1, STEPS + 1) if (eval_every and s % eval_every == 0) or s == STEPS})
        val_rounds = -(-val_windows // (self.micro_batch * self.data_ranks))
        val_rounds *= len(self.weights)  # each source's windows
        return held * (STEPS * self.micro_batches * (2 if full else 1) + evals * val_rounds)


@st.composite
def configs(draw, world: int) -> Drawn:
    layout = draw(st.sampled_from([x for x in PINNED if math.prod(x) == world] or LAYOUTS[world]))
    pp = layout[0]
    micro_batches = draw(st.integers(2 * pp, 4) if pp > 1 else st.integers(1, 4))
    fp8 = draw(st.booleans())
    options = [
        f"--data.val_windows={draw(st.integers(1, 5))}",
        f"--log.eval_every={draw(st.sampled_from([0, 2]))}",
        f"--train.lbl_coef={draw(st.sampled_from([0.0, 1e-2]))}",
        f"--train.z_loss_coef={draw(st.sampled_from([0.0, 1e-3]))}",
        f"--train.bias_rate={draw(st.sampled_from([0.0, 1e-2]))}",
        f"--train.ac={draw(st.sampled_from(['none', 'selective', 'full']))}",
        f"--parallel.overlap={draw(st.booleans())}".lower(),
        f"--parallel.wgrad_delay={draw(st.booleans())}".lower(),
        f"--train.fp8={fp8}".lower(),
        f"--optim.name={draw(st.sampled_from(['adamw', 'muon']))}",
        f"--optim.muon_ns_dtype={draw(st.sampled_from(['bfloat16', 'float32']))}",
        f"--optim.schedule={draw(st.sampled_from(['cosine', 'wsd']))}",
        f"--optim.grad_clip={draw(st.sampled_from([0.0, 0.5]))}",
        f"--checkpoint.every={draw(st.sampled_from([0, 1]))}",
    ]
    if fp8:
        options += [f"--train.fp8_lm_head={draw(st.booleans())}".lower()]
        options += [f"--train.fp8_all_gather={draw(st.booleans())}".lower()]
    pinned = AUX_ON * (world > 1) + PINNED_OPTIONS
    keys = {o.partition("=")[0] for o in pinned}
    options = [o for o in options if o.partition("=")[0] not in keys] + pinned
    family = draw(st.sampled_from(sorted(FAMILIES)))
    micro_batch, stop_at = draw(st.sampled_from([1, 2])), draw(st.integers(1, 2))
    flags = [draw(st.booleans()) for _ in range(3)]
    weights = draw(st.lists(st.sampled_from([0.25, 1.0, 3.0]), min_size=1, max_size=3))
    return Drawn(family, layout, micro_batches, micro_batch, options, stop_at, *flags, weights)


def distinct(drawn: st.SearchStrategy) -> st.SearchStrategy:
    """Two different configurations (one start of the processes trains both)."""
    return st.lists(drawn, min_size=2, max_size=2, unique_by=repr)


FIXTURES = HealthCheck.function_scoped_fixture  # the session's and module's, set up once


class Setup:
    """What the drawn runs read: each family's tiny model as a Hugging Face directory (fp32), the
    training data and two more sources to blend with it, a validation dataset of other files, and
    checkpoints of 2 plain steps to start from (made when first asked for, one per family and optimizer)."""

    def __init__(self, root: Path, micro_hf: Path, data: Path):
        self.root, self.data, self.val_data = root, data, root / "val"
        prepare(stdlib_corpus()[3:5], str(self.val_data), "byte", progress=False, workers=1)
        rng, text = random.Random(0), Path(stdlib_corpus()[0]).read_text()
        docs = root / "short_docs.jsonl"
        starts = (rng.randrange(len(text) - 12) for _ in range(800))
        docs.write_text(
            "".join(json.dumps({"text": text[i : i + rng.randint(0, 11)]}) + "\n" for i in starts)
        )
        self.short_docs = root / "short_docs"
        prepare([str(docs)], str(self.short_docs), "byte", progress=False, workers=1)
        self.more = [root / "blend_a", root / "blend_b"]
        for i, path in enumerate(self.more):
            prepare(stdlib_corpus()[5 + i : 6 + i], str(path), "byte", progress=False, workers=1)
        micro = dataclasses.replace(pith_models.from_pretrained(micro_hf).cfg, num_hidden_layers=4)
        self.hf = {name: root / name for name in FAMILIES}
        for name, cfg in FAMILIES.items():
            pith_models.save_pretrained(
                pith_models.build(cfg or micro, "cpu", seed=0), self.hf[name], torch.float32
            )

    def source(self, family: str, optimizer: str) -> Path:
        run = self.root / f"source_{family}_{optimizer}"
        if not run.exists():
            args = [f"--model.name={self.hf[family]}", f"--data.path={self.data}", f"--data.seq_len={SEQ}"]
            args += [
                "--train.steps=2",
                "--train.global_batch=4",
                "--train.micro_batch=4",
                "--train.device=cpu",
            ]
            pretrain(load_config(None, [*args, f"--optim.name={optimizer}", "--log.progress=false"]), run)
        return run / "checkpoints" / "step_000002"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, micro_hf, byte_data) -> Setup:
    return Setup(tmp_path_factory.mktemp("config_space"), micro_hf, byte_data)


def _values(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    assert all("val_loss" in r for r in rows if r["step"] == STEPS)
    return [{k: r[k] for k in ("loss", "grad_norm", "aux", "val_loss") if k in r} for r in rows]


def _option(drawn: Drawn, key: str) -> str:
    return next(o for o in drawn.options if o.startswith(f"--{key}=")).partition("=")[2]


def check(drawn: Drawn, root: Path, setup: Setup, calls: list[int]) -> None:
    """The invariants of the module docstring, on the runs `root`/{full, resumed} of `drawn` (trained),
    against the plain run, trained here; calls: each rank's attention calls in the full run."""
    plain = pretrain(load_config(None, drawn.overrides(setup, plain=True)), root / "plain")
    assert plain["step"] == STEPS
    want, got = _values(root / "plain"), _values(root / "full")
    fp8 = _option(drawn, "train.fp8") == "true"
    muon_bf16 = _option(drawn, "optim.name") == "muon" and _option(drawn, "optim.muon_ns_dtype") == "bfloat16"
    kind = "fp8" if fp8 else "muon" if muon_bf16 else "fp32"
    for step, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys(), (drawn, got, want)
        for key in a:
            rtol = RTOL.get(f"{kind} {key}", RTOL[kind])[step > 0]
            assert abs(a[key] - b[key]) <= rtol * abs(b[key]), (drawn, step + 1, key, got, want)
    assert _values(root / "resumed") == got, drawn  # bit for bit
    val_windows, eval_every = int(_option(drawn, "data.val_windows")), int(_option(drawn, "log.eval_every"))
    expected = [drawn.attention_calls(r, val_windows, eval_every) for r in range(len(calls))]
    assert calls == expected, (drawn, calls, expected)


class CountAttention:
    """A global forward hook counting calls of modules named Attention (every family's; as pretrains.py)."""

    def __enter__(self):
        self.calls = []
        count = lambda module, inputs, output: self.calls.append(type(module).__name__ == "Attention")
        self.handle = torch.nn.modules.module.register_module_forward_hook(count)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@settings(max_examples=settings.default.max_examples // 2, suppress_health_check=[FIXTURES])
@given(drawn=configs(world=1))
def test_one_process_configs_train_like_the_plain_run_and_resume_bit_for_bit(drawn, setup):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = load_config(None, drawn.overrides(setup))
        with CountAttention() as count:
            pretrain(cfg, root / "full")
        pretrain(cfg, root / "resumed", stop_at=drawn.stop_at)
        pretrain(cfg, root / "resumed")
        check(drawn, root, setup, [sum(count.calls)])


@pytest.mark.distributed
# No shrinking: each example starts processes (a failure shows the drawn configurations as they came).
@settings(
    max_examples=settings.default.max_examples // 12,
    suppress_health_check=[FIXTURES],
    phases=[Phase.generate],
)
@given(pairs=distinct(configs(world=2)), fours=distinct(configs(world=4)))
def test_layouts_of_2_and_4_processes_train_like_the_plain_run_and_resume_bit_for_bit(
    pairs, fours, setup, run_ranks
):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for world, drawn_list in ((2, pairs), (4, fours)):
            if PINNED and world not in map(math.prod, PINNED):
                continue
            runs = []
            for i, drawn in enumerate(drawn_list):
                args = drawn.overrides(setup)
                d = root / f"w{world}_{i}"
                runs += [
                    {"run_dir": str(d / "full"), "argv": args, "count": True},
                    {"run_dir": str(d / "resumed"), "argv": args, "stop_at": drawn.stop_at},
                    {"run_dir": str(d / "resumed"), "argv": args},
                ]
            run_ranks(Path(__file__).with_name("pretrains.py"), world, root, *map(json.dumps, runs))
            for i, drawn in enumerate(drawn_list):
                d = root / f"w{world}_{i}"
                calls = [int((d / "full" / f"attention_calls.{r}").read_text()) for r in range(world)]
                check(drawn, d, setup, calls)
