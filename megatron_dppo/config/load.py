"""YAML file + dotted command-line overrides -> a Config (unknown keys and wrong types named), and
the resolved config saved with a run."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing

import yaml

from megatron_dppo.config.checks import inert_keys, validate
from megatron_dppo.config.schema import OPTIONAL_KEYS, Config

_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
# Infinity as a command line or YAML 1.1 gives it: `.inf` is YAML's float, `inf` reaches us a string.
_INFINITY = re.compile(r"^[+-]?\.?(inf|infinity)$", re.IGNORECASE)
# The number keys where infinity means something (what it means): every other one must be finite.
UNBOUNDED_KEYS = {"algorithm.rollout_correction_cap": "untruncated weights"}


def _number(key: str, value) -> float:
    """A float key's value: a number, a numeric string ("1e-5": YAML 1.1 reads a float without a
    dot as a string), or infinity where UNBOUNDED_KEYS allow it. ValueError saying what is allowed."""
    if isinstance(value, str) and _INFINITY.match(value.strip()):
        value = float(value.strip().replace(".", ""))
    elif isinstance(value, str) and _FLOAT.match(value.strip()):
        value = float(value)
    unbounded = UNBOUNDED_KEYS.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value) or (unbounded and value == math.inf):
            return float(value)
    allowed = f"a finite number (e.g. 2, 0.5, 1e-3){f', or inf for {unbounded}' if unbounded else ''}"
    got = f"{value!r} ({type(value).__name__})" if not isinstance(value, float) else f"{value}"
    raise ValueError(f"config key {key!r}: expected {allowed}, got {got}")


def _coerce(key: str, value, typ):
    """Check value against the dataclass field type; ints are accepted for floats, and so are
    strings like "1e-5" (YAML 1.1 reads a float without a dot as a string) and infinity where
    UNBOUNDED_KEYS allow it (_number)."""
    origin = typing.get_origin(typ)
    if typ is typing.Any:
        return value
    if origin is list:
        (item_type,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise ValueError(f"config key {key!r}: expected a list, got {value!r} ({type(value).__name__})")
        return [_coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
    if origin is typing.Literal:
        choices = typing.get_args(typ)
        if value in choices:
            return value
        raise ValueError(f"config key {key!r}: expected one of {choices}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ValueError as e:
                error = e
        raise error
    if origin is dict and isinstance(value, dict):  # {name: value}: each entry checked, named key.name
        key_type, value_type = typing.get_args(typ)
        return {_coerce(f"{key}.{k}", k, key_type): _coerce(f"{key}.{k}", v, value_type) for k, v in value.items()}
    if typ is float:
        return _number(key, value)
    if typ in (int, str, bool) and type(value) is typ:
        return value
    raise ValueError(
        f"config key {key!r}: expected {getattr(typ, '__name__', typ)}, got {value!r} ({type(value).__name__})"
    )


def _apply(obj, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ValueError(f"config section {prefix.rstrip('.') or '<root>'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in names:
            raise ValueError(f"unknown config key {key!r}; valid keys here: {sorted(names)}")
        current = getattr(obj, k)
        if dataclasses.is_dataclass(current):
            _apply(current, v, key + ".")
        elif isinstance(current, dict) and isinstance(v, dict):  # a mapping key: entries merge (overrides add)
            setattr(obj, k, {**current, **_coerce(key, v, hints[k])})
        else:
            setattr(obj, k, _coerce(key, v, hints[k]))


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ValueError(
                    f"line {key_node.start_mark.line + 1}: key {key!r} appears twice in the same "
                    f"section (first at line {seen[key]}); merge them"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def parse_override(text: str):
    """'a.b=value' -> (['a', 'b'], value parsed as YAML)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ValueError(
            f"override {key.strip()!r}: the value {raw!r} is not valid YAML ({' '.join(str(e).split())[:120]}); "
            "quote it, e.g. key=\"'value'\""
        ) from None


def _override_path(cfg: Config, key: str) -> list[str]:
    """An override's key split into its sections and field; below a mapping field the rest is one
    entry's name, dots and all (reward.by_source.my.source=math: the data_source 'my.source')."""
    parts, obj = key.split("."), cfg
    for i, part in enumerate(parts):
        value = getattr(obj, part, None) if dataclasses.is_dataclass(obj) else None
        if isinstance(value, dict) and i + 2 < len(parts):
            return parts[: i + 1] + [".".join(parts[i + 1 :])]
        obj = value
    return parts


def load_config(path: str | None = None, overrides=(), check: bool = True) -> Config:
    cfg = Config()
    if path:
        with open(path) as f:
            try:
                data = yaml.load(f, Loader=_UniqueKeyLoader) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
        try:
            _apply(cfg, data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    apply_overrides(cfg, overrides)
    return validate(cfg) if check else cfg


def apply_overrides(cfg: Config, overrides) -> Config:
    """cfg (changed in place) with dotted section.key=value overrides applied, each value parsed
    and checked as the YAML file's would be; not validated as a whole (load_config does that)."""
    for text in overrides:
        key, value = parse_override(text)
        nested: dict = value
        for part in reversed(_override_path(cfg, key)):
            nested = {part: nested}
        _apply(cfg, nested)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def unused_keys(cfg: Config) -> list[str]:
    """The keys of inert_keys (dotted; a section stands for all its fields)."""
    return list(inert_keys(cfg))


def _drop_key(data: dict, key: str) -> None:
    *sections, name = key.split(".")
    for s in sections:
        data = data[s]
    data.pop(name, None)


def save_config(cfg: Config, path: str) -> None:
    """The resolved config, as it ran. Unset optional paths are left out (loading the file back
    gives them their empty default); any other None means `resolve` was skipped: an error."""
    data = to_dict(cfg)
    for key in OPTIONAL_KEYS:
        section, name = key.split(".")
        if not data[section][name]:
            del data[section][name]
    for key in unused_keys(cfg):
        _drop_key(data, key)
    unresolved = [f"{s}.{k}" for s, sec in data.items() for k, v in sec.items() if v is None]
    if unresolved:
        raise ValueError(f"config keys {unresolved} are unresolved: call config.resolve() before saving")
    with open(path, "w") as f:
        f.write(
            "# The resolved config of this run. Left out: optional paths that were not given, and keys "
            "the method does not read.\n"
        )
        yaml.safe_dump(data, f, sort_keys=False)
