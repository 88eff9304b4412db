import dataclasses
import tempfile
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pith_train.config import Config, load_config, to_toml, validate


def test_defaults_toml_and_overrides_resolve_in_order(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        '[train]\nsteps = 7\nlr = 1\n[optim]\nschedule = "wsd"\n[model]\nname = "qwen3-moe-tiny"\n'
    )
    cfg = load_config(str(path), ["--train.steps=9", "--train.compile=false", "data.seq_len=64"])
    assert (cfg.train.steps, cfg.train.lr, cfg.optim.schedule) == (9, 1.0, "wsd")
    assert isinstance(cfg.train.lr, float) and cfg.train.compile is False and cfg.data.seq_len == 64
    assert cfg.model.name == "qwen3-moe-tiny" and cfg.train.micro_batch == Config().train.micro_batch


def test_printed_config_reads_back_equal(tmp_path):
    cfg = load_config(None, ["--train.seed=3", '--data.tokenizer=my tok "x".json', "--optim.eps=1e-12"])
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    assert load_config(str(tmp_path / "c.toml")) == cfg


@pytest.mark.parametrize(
    "toml, overrides, message",
    [
        ("", ["--train.stepz=3"], "unknown key train.stepz"),
        ("", ["--trian.steps=3"], "unknown section [trian]"),
        ("", ["--train.steps=three"], "expected int, got 'three'"),
        ("", ["--train.compile=yes"], "expected true or false"),
        ("", ["--train.steps"], "expected --section.key=value"),
        ("[train]\nsteps = 1.5\n", [], "train.steps: expected int, got float"),
        ("[train]\nlr = true\n", [], "train.lr: expected float, got bool"),
        ('[train]\nsteps = "30"\n', [], "train.steps: expected int, got str '30'"),
        ('[train]\ncompile = "false"\n', [], "train.compile: expected bool, got str 'false'"),
        ("[data]\nextra = 1\n", [], "unknown key data.extra"),
        ("steps = 1\n", [], "must be a [section]"),
        ("[train\n", [], "not valid TOML"),
        ("", ["--train.global_batch=6", "--train.micro_batch=4"], "global_batch=6 must be a multiple"),
        ("", ["--optim.schedule=linear"], "'cosine' or 'wsd'"),
        ("", ["--train.steps=0"], "train.steps must be >= 1"),
        ("", ["--train.cuda_graph=true", "--parallel.cp=2"], "train.cuda_graph runs on one process"),
        ("", ["--train.fp8_all_gather=true"], "train.fp8_all_gather gathers the FP8 GEMMs' weights"),
        ("", ["--train.lr=-1"], "train.lr must be > 0, got -1.0"),
        ("", ["--optim.grad_clip=-1"], "optim.grad_clip must be >= 0 (0 turns clipping off), got -1.0"),
        ("", ["--optim.beta1=1"], "optim.beta1 must be in [0, 1), got 1.0"),
        ("", ["--optim.beta2=-0.5"], "optim.beta2 must be in [0, 1), got -0.5"),
        ("", ["--optim.eps=0"], "optim.eps must be > 0, got 0.0"),
        ("", ["--optim.weight_decay=-0.1"], "optim.weight_decay must be >= 0, got -0.1"),
        ("", ["--data.path=a,b"], "data.weights []: give one per data.path (2), > 0"),
        ("", ["--data.path=a,b", "--data.weights=1,0"], "data.weights [1.0, 0.0]: give one per data.path"),
        ("", ["--data.weights=1,2"], "data.weights [1.0, 2.0]: give one per data.path (1)"),
        ("", ["--data.path=a,b", "--data.weights=1,nan"], "data.weights [1.0, nan]: give one"),
        ("", ["--data.path=a,b", "--data.weights=1,1e-6"], ">= 1/65536 of their sum"),
        ("", ["--data.path=a,b", "--data.weights=1,x"], "expected float, got 'x'"),
        (
            "",
            ["--data.path=a,b", "--data.weights=1,1", "--data.val_path=v"],
            "one per data.path (2), or none",
        ),
        ("[data]\nweights = 1.0\n", [], "data.weights: expected an array, got 1.0"),
        ("", ["--data.path=a,b", "--data.weights=0,0"], "data.weights [0.0, 0.0]: give one per data.path"),
        ("", ["--train.seed=-1"], "train.seed must be in [0, 2**63), got -1"),
        (
            "",
            ["--data.path=[oops"],
            'data.path=[oops\': \'[oops\' is not a JSON array: give ["a", "b"] or a,b',
        ),
        ('[data]\npath = ["a", 2]\n', [], "data.path: expected str, got int 2"),
    ],
)
def test_bad_config_raises_naming_the_problem(tmp_path, toml, overrides, message):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ValueError) as e:
        load_config(str(path), overrides)
    assert message in str(e.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="nope.toml"):
        load_config("nope.toml")
    (tmp_path / "latin1.toml").write_bytes(b"[train]\nsteps = 1  # caf\xe9\n")
    with pytest.raises(ValueError, match="latin1.toml: not valid TOML"):
        load_config(str(tmp_path / "latin1.toml"))
    with pytest.raises(ValueError, match="is a directory, not a config file"):
        load_config(str(tmp_path))


def test_data_lists_are_toml_arrays_or_comma_separated_and_one_path_is_a_string_too(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[data]\npath = ["a", "b"]\nweights = [3, 1]\nval_path = "va,vb"\n')
    cfg = load_config(str(path))
    assert (cfg.data.path, cfg.data.weights, cfg.data.val_path) == (["a", "b"], [3.0, 1.0], ["va", "vb"])
    assert load_config(None, ["--data.path=a,b", "--data.weights=3,1", "--data.val_path=va,vb"]) == cfg
    path.write_text('[data]\npath = "one"\nval_path = ""\n')  # as a run's config.toml before blends
    assert (load_config(str(path)).data.path, load_config(str(path)).data.val_path) == (["one"], [])
    (tmp_path / "back.toml").write_text(to_toml(cfg))
    assert load_config(str(tmp_path / "back.toml")) == cfg


def _floats() -> list[str]:
    """Every float key of the config, as section.key."""
    return [
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(Config)
        for f in dataclasses.fields(s.type)
        if f.type is float
    ]


@pytest.mark.parametrize("key", _floats())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1"])
def test_every_float_key_is_range_checked(key, value):
    with pytest.raises(ValueError, match=f"{key} must be"):
        load_config(None, [f"--{key}={value}"])


def test_a_non_finite_model_override_is_refused():
    with pytest.raises(ValueError, match="rope_theta must be finite"):
        load_config(None, ["--model.name=qwen3-moe-tiny", "--model.rope_theta=inf"])
    with pytest.raises(ValueError, match="hidden_size must be >= 1"):
        load_config(None, ["--model.hidden_size=0"])


def test_non_bmp_and_control_characters_are_written_as_valid_toml(tmp_path):
    cfg = load_config(None, ["--log.wandb=proj-\U0001f680", "--data.path=a\x7fb\x01\n\"'\\c"])
    (tmp_path / "c.toml").write_text(to_toml(cfg), encoding="utf-8")
    assert load_config(str(tmp_path / "c.toml")) == cfg


# The enumerated strings validate accepts, so draws reach them; any other text is refused or written.
WORDS = ["none", "selective", "full", "cosine", "wsd", "adamw", "muon", "bfloat16", "float32"]
WORDS += ["auto", "cpu", "cuda", "byte", "tiny-moe", "qwen3-moe-tiny"]
KINDS = {
    int: st.integers(0, 64) | st.integers(-(2**63), 2**63 - 1),
    float: st.floats(0, 1) | st.floats(),
    bool: st.booleans(),
    str: st.sampled_from(WORDS) | st.text(),
}
KINDS |= {list[str]: st.lists(KINDS[str], max_size=3), list[float]: st.lists(KINDS[float], max_size=3)}


@st.composite
def configs(draw) -> Config:
    cfg, fields = (
        Config(),
        [(s.name, f) for s in dataclasses.fields(Config) for f in dataclasses.fields(s.type)],
    )
    for section, f in draw(st.lists(st.sampled_from(fields), max_size=3)):  # a few: most draws validate
        if f.name != "overrides":
            setattr(getattr(cfg, section), f.name, draw(KINDS[f.type]))
    if draw(st.booleans()):  # a preset's fields: a float, an int, a tuple (gpt-oss's layer_types)
        cfg.model.name = draw(st.sampled_from(["qwen3-moe-tiny", "gpt-oss-tiny"]))
        cfg.model.overrides = {"rope_theta": draw(KINDS[float]), "num_hidden_layers": draw(st.integers(1, 4))}
    return cfg


@settings(max_examples=300)
@given(configs())
def test_every_config_field_round_trips_through_toml_or_is_refused(cfg):
    try:
        validate(cfg)
    except ValueError:
        return
    assert tomllib.loads(text := to_toml(cfg)) is not None
    assert load_config_text(text) == cfg


def load_config_text(text: str) -> Config:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "c.toml")
        path.write_text(text, encoding="utf-8")
        return load_config(str(path))
