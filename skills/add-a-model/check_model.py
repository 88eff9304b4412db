"""add-a-model: check that a model module follows the conventions of pith_models/hf.py and passes
validate-correctness at its TINY size. Give a module name (pith_models.qwen3_moe) or a .py file.
Prints one line per check; ends with PASS, or FAIL naming every broken convention.

Shape legend: E experts.
"""

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # skills/, for _common
import _common  # noqa: E402
import pith_models  # noqa: E402
import torch  # noqa: E402
from pith_engine.parallel import num_experts  # noqa: E402
from pith_models import hf  # noqa: E402
from torch import nn  # noqa: E402

REQUIRED = ("Config", "Model", "init_weights", "from_hf_state_dict", "to_hf_state_dict", "TINY")
MODEL_METHODS = ("prologue", "positions", "epilogue", "reference_forward")
LAYER_METHODS = ("stage1", "stage3", "stage5", "reference_forward")
TESTS = Path(__file__).resolve().parents[2] / "packages" / "pith-models" / "tests"


def load(target: str) -> ModuleType:
    if not target.endswith(".py"):
        return importlib.import_module(target)
    path = Path(target)
    if not path.is_file():
        raise ValueError(f"{target}: expected a module name or an existing .py file, found no such file")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(m: ModuleType, hf_parity: bool) -> list[str]:
    failures = []

    def expect(ok: bool, what: str) -> bool:
        print(f"  {'ok  ' if ok else 'FAIL'}  {what}")
        if not ok:
            failures.append(what)
        return ok

    missing = [name for name in REQUIRED if not hasattr(m, name)]
    if not expect(not missing, f"module defines {', '.join(REQUIRED)} (missing: {missing or 'none'})"):
        return failures
    doc = m.__doc__ or ""
    expect("Architectural choices" in doc and "Shape legend" in doc,
           "module docstring lists the architectural choices and a shape legend")  # fmt: skip
    # -- the config dataclass
    Config, cfg = m.Config, m.TINY
    params = getattr(Config, "__dataclass_params__", None)
    expect(params is not None and params.frozen, "Config is a @dataclass(frozen=True)")
    expect(isinstance(cfg, Config), "TINY is a Config")
    model_type = getattr(Config, "model_type", None)
    expect(isinstance(model_type, str), f"Config.model_type is the HF model_type string (got {model_type!r})")
    names = [f.name for f in dataclasses.fields(Config)]
    expect("tie_word_embeddings" in names, "Config has a field tie_word_embeddings")
    source = inspect.getsource(Config)
    uncommented = [
        n
        for n in names
        if not any(ln.strip().startswith(f"{n}:") and "#" in ln for ln in source.splitlines())
    ]
    expect(not uncommented, f"every Config field has a comment (lacking: {uncommented or 'none'})")
    d = cfg.to_hf()
    expect(d.get("model_type") == model_type and bool(d.get("architectures")),
           "to_hf() gives model_type and architectures")  # fmt: skip
    expect(Config.from_hf(d) == cfg, "Config.from_hf(cfg.to_hf()) == cfg")
    try:
        Config.from_hf({**d, "no_such_field": 1})
        rejected = False
    except ValueError:
        rejected = True
    expect(rejected, "from_hf raises ValueError on an unknown field")
    # -- the two literal dicts
    registered = getattr(hf.MODULES.get(model_type), "__file__", None)
    expect(registered == m.__file__, f"pith_models.hf.MODULES[{model_type!r}] is this module")
    expect(any(c == cfg for c in pith_models.MODELS.values()), "pith_models.MODELS names its TINY config")
    # -- the model on meta: the contract, expert layout, routing bias
    with torch.device("meta"):
        model = m.Model(cfg)
    expect(
        all(p.is_meta for p in model.parameters()), "Model(cfg) under torch.device('meta') allocates nothing"
    )
    expect(model.cfg is cfg, "model.cfg is the config")
    keys = [str(i) for i in range(cfg.num_hidden_layers)]
    expect(isinstance(model.layers, nn.ModuleDict) and list(model.layers) == keys
           and isinstance(model.lm_head, nn.Linear),
           "model.layers is an nn.ModuleDict keyed by global index, model.lm_head an nn.Linear")  # fmt: skip
    lacking = [f"Model.{n}" for n in MODEL_METHODS if not callable(getattr(model, n, None))]
    for i, layer in model.layers.items():
        lacking += [
            f"layers[{i}].{n}" for n in (*LAYER_METHODS, "experts", "router") if not hasattr(layer, n)
        ]
    if not expect(not lacking, f"the MoEModel / DecoderLayer contract (lacking: {lacking or 'none'})"):
        return failures
    E = num_experts(model)
    moe = [layer for layer in model.layers.values() if layer.experts is not None]
    expect(bool(moe), f"TINY has MoE layers ({len(moe)} of {len(model.layers)}, E = {E})")
    sd = model.state_dict()
    bias = [(k, v) for k, v in sd.items() if k.endswith("expert_bias")]
    expect(len(bias) == len(moe) and all(v.shape == (E,) and v.dtype == torch.float32 for _, v in bias),
           "each MoE layer has a persistent fp32 expert_bias [E]")  # fmt: skip
    expect(all(p.shape[0] == E for layer in moe for p in layer.experts.parameters()),
           "expert parameters are stacked [E, ...]")  # fmt: skip
    # -- state-dict mapping: on meta (names, shapes), then values on a real model
    back = m.from_hf_state_dict(m.to_hf_state_dict(sd, cfg), cfg)
    expect({k: v.shape for k, v in back.items()} == {k: v.shape for k, v in sd.items()},
           "from_hf_state_dict(to_hf_state_dict(sd)) has sd's names and shapes (meta)")  # fmt: skip
    try:
        m.init_weights(model, 0)
        refused = False
    except ValueError:
        refused = True
    expect(refused, "init_weights raises ValueError on a meta model")
    a, b = (pith_models.build(cfg, "cpu", seed=3) for _ in range(2))
    expect(all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters())), "init_weights is seeded")
    sd = a.state_dict()
    back = m.from_hf_state_dict(m.to_hf_state_dict(sd, cfg), cfg)
    expect(back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd),
           "state dicts round-trip through the HF names exactly")  # fmt: skip
    stem = Path(m.__file__).stem
    expect((TESTS / f"test_{stem}.py").is_file(), f"tests in packages/pith-models/tests/test_{stem}.py")
    # -- validate-correctness at TINY size
    print("  validate-correctness on TINY:")
    _common.perturb(a, 1)
    ids_BS = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    failures += _common.correctness(a, ids_BS, hf=hf_parity)
    return failures


def main(argv: list[str] | None) -> tuple[bool, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", help="e.g. pith_models.qwen3_moe, or path/to/family.py")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    args = parser.parse_args(argv)
    module = load(args.module)
    print(f"{module.__name__} ({module.__file__})")
    failures = check(module, not args.no_hf)
    return not failures, "; ".join(failures) or "every convention holds and validate-correctness passes"


if __name__ == "__main__":
    _common.verdict(main)
