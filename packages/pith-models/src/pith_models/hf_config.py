"""The config.json checks that every family's Config.from_hf shares (its own fields converted first)."""

from dataclasses import MISSING, fields


def config_kwargs_from_hf(d: dict, cls: type, fixed: dict, ignored: tuple[str, ...]) -> dict:
    """The checks every Config.from_hf ends with, on config.json's dict once the model converted its
    own fields: a `fixed` field (its other values would change the math) holding another value, a
    field the dataclass `cls` lacks, or a required field absent is a ValueError naming it; `ignored`
    fields (no effect on the math) are dropped. -> the keyword arguments of cls."""
    d = {k: v for k, v in d.items() if k not in ignored}
    for key, allowed in fixed.items():
        if key in d and d.pop(key) != allowed:
            raise ValueError(f"config field {key}: only {allowed!r} is supported")
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"unsupported {cls.model_type} config fields: {unknown}")
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in d]
    if missing:
        raise ValueError(f"{cls.model_type} config lacks required fields: {missing}")
    return d


def yarn_params_from_hf(d: dict, default_theta: float, yarn_cls: type) -> tuple[float, dict | None]:
    """Pop rope_parameters (transformers 5) or rope_scaling + rope_theta (4.x) from config.json's dict
    -> (theta, the YaRN parameters; None for the default rope). Another rope type, a parameter of the
    default rope or a YaRN parameter that is no field of the dataclass `yarn_cls` is a ValueError."""
    rope = dict(d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {})
    theta = float(rope.pop("rope_theta", d.pop("rope_theta", default_theta)))
    d.pop("rope_scaling", None)
    rope_type = rope.pop("rope_type", rope.get("type", "default"))
    rope.pop("type", None)
    if rope_type == "default":
        if rope:
            raise ValueError(f"unsupported parameters of the default rope: {sorted(rope)}")
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"rope type {rope_type!r} is not supported (only default and yarn)")
    unknown = sorted(set(rope) - {f.name for f in fields(yarn_cls)})
    if unknown:
        raise ValueError(f"unsupported yarn rope parameters: {unknown}")
    return theta, rope
