"""The run configuration: dataclasses with a default for every key, read from TOML, then
`--section.key=value` overrides; ValueError for anything unknown, mistyped or inconsistent."""

import dataclasses
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path

# Samples over which a blend's mix is exact (pith_train.data.Blend): its finest share.
BLEND_BLOCK = 1 << 16
# train.ac's policies, weakest first
AC = ("none", "selective", "full")


@dataclass
class ModelConfig:
    # A name in pith_models.MODELS, a Hugging Face directory or a Pith checkpoint
    name: str = "tiny-moe"
    # Every other [model] key sets that field of a preset's config (`num_hidden_layers = 2`)
    overrides: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    # Prepared datasets, several mixed by data.weights (pith-train README, Blends); [] = the built-in
    # corpus (RUN_DIR/data). Lists: TOML arrays, or comma-separated on the command line
    path: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # one per data.path, > 0, normalised; [] for one
    tokenizer: str = "byte"  # "byte" or a tokenizer.json: the dataset's
    seq_len: int = 128  # tokens per training sequence
    # Prepared datasets (same tokenizer) of the validation loss, one per data.path; [] = windows held out
    val_path: list[str] = field(default_factory=list)
    # Windows of the validation loss, spread over the set (as Megatron's eval-iters)
    val_windows: int = 16
    # Each packed document trains alone: own attention, positions from 0, no label into the next
    document_mask: bool = False


@dataclass
class TrainConfig:
    steps: int = 120  # optimizer steps
    global_batch: int = 8  # sequences per optimizer step, over all data ranks
    micro_batch: int = 8  # sequences per forward/backward on one data rank (gradient accumulation)
    lr: float = 3e-3  # peak learning rate
    seed: int = 0  # weight init and data order
    device: str = "auto"  # auto (cuda if present) | cpu | cuda
    compile: bool = True  # torch.compile the non-expert stages (CUDA only)
    ac: str = "none"  # activation checkpointing: none | selective (expert MLPs) | full (every stage)
    fp8: bool = False  # projections and expert GEMMs in FP8 (e4m3)
    fp8_lm_head: bool = False  # lm_head's three GEMMs in FP8 too
    # Under FSDP2, all-gather the FP8 weights in e4m3 (half bf16's bytes); under compile the experts' only
    fp8_all_gather: bool = False
    # The step's forward and backward as one CUDA graph from the second step (one CUDA process)
    cuda_graph: bool = False
    # Global-batch load-balancing loss coefficient (0 = off; pith-train README, Expert balance)
    lbl_coef: float = 3e-2
    z_loss_coef: float = 0.0  # router z-loss coefficient (0 = off)
    # Aux-loss-free balancing: expert-bias step after each update (0 = off); no HF family holds it
    bias_rate: float = 0.0
    # Intra-op threads on CPU (0 = torch's default, whose OpenMP spin-waits slow a busy machine 10x)
    cpu_threads: int = 1


@dataclass
class OptimConfig:
    # adamw | muon (on the hidden matrices, AdamW on the rest; lr and weight_decay mean the same)
    name: str = "adamw"
    muon_momentum: float = 0.95  # Muon's (Nesterov) momentum
    muon_ns_dtype: str = "bfloat16"  # bfloat16 | float32: dtype of Muon's Newton-Schulz iterations
    schedule: str = "cosine"  # cosine (linear warmup, cosine decay) | wsd (warmup, stable, decay)
    warmup_steps: int = 12
    min_lr_ratio: float = 0.1  # final lr as a fraction of train.lr
    decay_fraction: float = 0.2  # wsd: fraction of the steps in the final linear decay
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm (0 = no clipping)


@dataclass
class ParallelConfig:
    pp: int = 1  # pipeline stages
    dp: int = 1  # data-parallel (FSDP) ranks
    cp: int = 1  # context-parallel ranks (share sequences, split them along time)
    ep: int = 1  # expert-parallel ranks (take different data, like dp)
    # Overlapped forward+backward pairs (F(m+1) with B(m) under pp=1) interleave at their all-to-alls
    overlap: bool = True
    # Weight gradients of the projections and expert GEMMs wait for the schedule's W slots, under
    # pp > 1 only (at pp = 1, no bubble, it costs speed and memory: pith-train README, Throughput)
    wgrad_delay: bool = True


@dataclass
class CheckpointConfig:
    every: int = 40  # steps between checkpoints (0 = only at the end, where one always is)
    keep: int = 2  # latest checkpoints kept
    resume: bool = True  # continue from the latest checkpoint in RUN_DIR/checkpoints
    # A checkpoint a new run starts from (its state, its data position if the order is the same, this
    # config's schedule from step 0); read only while RUN_DIR has no checkpoint
    init_from: str = ""


@dataclass
class LogConfig:
    progress: bool = True  # progress bar, when stderr is a terminal
    # Steps between stderr lines; 0 = every step, or none when stderr is a terminal (the bar)
    every: int = 0
    eval_every: int = 40  # steps between validation losses (0 = only at the end)
    tensorboard: bool = True  # TensorBoard event files in RUN_DIR/tensorboard
    wandb: str = ""  # a Weights & Biases project (needs the wandb package); "" = off


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def data_ranks(self) -> int:
        """Ranks that take different sequences (CP ranks share theirs)."""
        return self.parallel.dp * self.parallel.ep

    @property
    def world(self) -> int:
        return self.parallel.pp * self.parallel.dp * self.parallel.cp * self.parallel.ep

    def started(self, flag: str, n: int) -> None:
        if n != self.world:  # flag n starts n processes
            w = self.world
            raise ValueError(
                f"{flag} {n}: the layout pp*dp*cp*ep is {w}; give {flag} {w} or --parallel.pp/dp/cp/ep of {n}"
            )

    @property
    def micro_batches(self) -> int:
        return self.train.global_batch // (self.train.micro_batch * self.data_ranks)


def _typed(where: str, value, kind: type):
    """`value` as `kind` (an int is a float too), or ValueError."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _parse_text(where: str, text: str, kind: type):
    if kind is str:
        return text
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{where}: expected true or false, got {text!r}")
        return text.lower() == "true"
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{where}: expected {kind.__name__}, got {text!r}") from None


def _field_types(section) -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(section)}


def _set(cfg: Config, section: str, key: str, value, where: str, text: bool = False) -> None:
    sections = _field_types(cfg)
    if section not in sections:
        raise ValueError(f"{where}: unknown section [{section}]; sections are {sorted(sections)}")
    target = getattr(cfg, section)
    keys = _field_types(target)
    if section == "model" and key != "name":  # a preset field: checked once the preset is known
        target.overrides[key] = value
        return
    if key not in keys:
        raise ValueError(f"{where}: unknown key {section}.{key}; [{section}] has {sorted(keys)}")
    kind = keys[key]
    if typing.get_origin(kind) is list:  # [data]'s lists
        return setattr(target, key, list(_model_value(where, value, tuple[kind.__args__[0], ...])))
    value = _parse_text(where, value, kind) if text else value
    setattr(target, key, _typed(where, value, kind))


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the TOML file, then `section.key=value` overrides (leading dashes optional)."""
    cfg = Config()
    if path:
        if not Path(path).is_file():
            raise ValueError(
                f"config file {path!r} "
                + ("is a directory, not a config file" if Path(path).is_dir() else "does not exist")
            )
        with open(path, "rb") as f:
            try:
                doc = tomllib.load(f)
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: not valid TOML: {e}") from None
        for section, table in doc.items():
            if not isinstance(table, dict):
                raise ValueError(f"{path}: top-level key {section!r} must be a [section], got a value")
            for key, value in table.items():
                _set(cfg, section, key, value, f"{path}: {section}.{key}")
    for item in overrides:
        name, eq, text = item.lstrip("-").partition("=")
        section, dot, key = name.partition(".")
        if not eq or not dot:
            raise ValueError(f"override {item!r}: expected --section.key=value")
        _set(cfg, section, key, text, f"override {item!r}", text=True)
    validate(cfg)
    return cfg


def _model_value(where: str, value, kind):
    """A [model] override (or a [data] list) as its field's type: int, float, bool, str, `X | None`
    ("none") or a tuple (a TOML array, or on the command line its JSON text or "a,b"; a string "" none)."""
    if typing.get_origin(kind) in (types.UnionType, typing.Union):
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if typing.get_origin(kind) is tuple:
        items = value
        if isinstance(value, str):
            try:
                items = json.loads(value) if value.startswith("[") else value.split(",") if value else []
            except ValueError:
                raise ValueError(f'{where}: {value!r} is not a JSON array: give ["a", "b"] or a,b') from None
        if not isinstance(items, list | tuple):
            raise ValueError(f"{where}: expected an array, got {value!r}")
        return tuple(_model_value(where, v, typing.get_args(kind)[0]) for v in items)
    if kind not in (int, float, bool, str):
        raise ValueError(f"{where}: a field of type {kind} cannot be set from the config")
    value = _parse_text(where, value, kind) if isinstance(value, str) and kind is not str else value
    return _typed(where, value, kind)


def model_config(model: "ModelConfig | str"):
    """The model config of [model]: a preset with its overrides, or a directory's config.json."""
    import pith_models
    from pith_engine.checkpoint import checkpoints
    from pith_models.hf import config_from_hf

    model = ModelConfig(model) if isinstance(model, str) else model
    name = model.name
    if name not in pith_models.MODELS:
        path = Path(name)
        if not path.is_dir():
            raise ValueError(
                f"model.name {name!r}: not a known model ({sorted(pith_models.MODELS)}) nor a directory"
            )
        if not (path / "config.json").is_file():
            if run := checkpoints(path / "checkpoints"):
                raise ValueError(f"model.name {name!r}: a run directory; name a checkpoint, e.g. {run[-1]}")
            raise ValueError(f"model.name {name!r}: a model directory needs a config.json, and it has none")
        if model.overrides:
            raise ValueError(
                f"model overrides {sorted(model.overrides)}: they apply to a preset name, not to the"
                f" directory {name!r}, whose weights fix the shapes"
            )
        return config_from_hf(json.loads((path / "config.json").read_text()))
    base = pith_models.MODELS[name]
    hints = typing.get_type_hints(type(base))
    names = [f.name for f in dataclasses.fields(base)]
    typed = {}
    for key, value in model.overrides.items():
        if key not in names:
            raise ValueError(f"model.{key}: not a field of {name}'s config; its fields are {names}")
        typed[key] = _model_value(f"model.{key}", value, hints[key])
    try:
        return dataclasses.replace(base, **typed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model overrides of {name}: {e}") from None


def validate(cfg: Config) -> None:
    if cfg.model.overrides:  # the preset's fields and the overrides' types; the values as typed
        model = model_config(cfg.model)
        cfg.model.overrides = {k: getattr(model, k) for k in cfg.model.overrides}
    t, o = cfg.train, cfg.optim
    for section in dataclasses.fields(cfg):  # TOML has no inf or nan
        for key, value in dataclasses.asdict(getattr(cfg, section.name)).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{section.name}.{key} must be finite, got {value}")
    at_least = {  # key: the least allowed
        "train.steps": 1, "train.global_batch": 1, "train.micro_batch": 1, "data.seq_len": 1,
        "data.val_windows": 1, "checkpoint.keep": 1, "parallel.pp": 1, "parallel.dp": 1, "parallel.cp": 1,
        "parallel.ep": 1, "checkpoint.every": 0, "log.eval_every": 0, "log.every": 0, "train.cpu_threads": 0,
    }  # fmt: skip
    for key, least in at_least.items():
        if (value := attrgetter(key)(cfg)) < least:
            raise ValueError(f"{key} must be >= {least}, got {value}")
    if not 0 <= t.seed < 2**63:
        raise ValueError(f"train.seed must be in [0, 2**63), got {t.seed}")
    d, n = cfg.data, max(1, len(cfg.data.path))
    if (d.weights or n > 1) and (
        len(d.weights) != n or not 0 < min(d.weights) * BLEND_BLOCK >= sum(d.weights)
    ):
        raise ValueError(
            f"data.weights {d.weights}: give one per data.path ({n}), > 0 and >= 1/{BLEND_BLOCK} of their sum"
        )
    if d.val_path and len(d.val_path) != n:
        raise ValueError(f"data.val_path {d.val_path}: give one per data.path ({n}), or none")
    per_step = t.micro_batch * cfg.data_ranks
    if t.global_batch % per_step:
        raise ValueError(
            f"train.global_batch={t.global_batch} must be a multiple of train.micro_batch={t.micro_batch}"
            f" x data ranks (dp*ep={cfg.data_ranks}) = {per_step}"
        )
    if t.fp8_all_gather and not (t.fp8 or t.fp8_lm_head):
        raise ValueError(
            "train.fp8_all_gather gathers the FP8 GEMMs' weights: set train.fp8 (or turn it off)"
        )
    if t.cuda_graph and cfg.world > 1:
        raise ValueError(f"train.cuda_graph runs on one process, got pp*dp*cp*ep = {cfg.world}: turn it off")
    choices = {
        "optim.schedule": ("cosine", "wsd"), "optim.name": ("adamw", "muon"),
        "optim.muon_ns_dtype": ("bfloat16", "float32"), "train.ac": AC,
        "train.device": ("auto", "cpu", "cuda"),
    }  # fmt: skip
    for key, allowed in choices.items():
        if (value := attrgetter(key)(cfg)) not in allowed:
            names = ", ".join(map(repr, allowed[:-1]))
            raise ValueError(f"{key}: expected {names} or {allowed[-1]!r}, got {value!r}")
    off = ">= 0 (0 turns it off)"
    ranges = {  # key: (allowed, what the fix is)
        "train.lr": (t.lr > 0, "> 0"),
        "train.lbl_coef": (t.lbl_coef >= 0, off),
        "train.z_loss_coef": (t.z_loss_coef >= 0, off),
        "train.bias_rate": (t.bias_rate >= 0, off),
        "optim.warmup_steps": (o.warmup_steps >= 0, ">= 0"),
        "optim.grad_clip": (o.grad_clip >= 0, ">= 0 (0 turns clipping off)"),
        "optim.beta1": (0 <= o.beta1 < 1, "in [0, 1)"),
        "optim.beta2": (0 <= o.beta2 < 1, "in [0, 1)"),
        "optim.muon_momentum": (0 <= o.muon_momentum < 1, "in [0, 1)"),
        "optim.min_lr_ratio": (0 <= o.min_lr_ratio <= 1, "in [0, 1]"),
        "optim.decay_fraction": (0 <= o.decay_fraction <= 1, "in [0, 1]"),
        "optim.eps": (o.eps > 0, "> 0"),
        "optim.weight_decay": (o.weight_decay >= 0, ">= 0"),
    }
    for key, (ok, allowed) in ranges.items():
        if not ok:
            raise ValueError(f"{key} must be {allowed}, got {attrgetter(key)(cfg)}")


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML that load_config reads back to an equal Config."""
    lines = []
    for section in dataclasses.fields(cfg):
        lines.append(f"[{section.name}]")
        values = dataclasses.asdict(getattr(cfg, section.name))
        values.update(values.pop("overrides", {}))  # [model]: the preset's fields it sets, as keys
        for key, value in values.items():  # JSON's values are TOML's (DEL escaped; floats finite)
            text = json.dumps("none" if value is None else value, ensure_ascii=False)
            lines.append(f"{key} = " + text.replace("\x7f", "\\u007f"))
        lines.append("")
    return "\n".join(lines)
