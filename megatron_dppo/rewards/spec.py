"""Reward specs: which function scores a completion, as the config names it.

    "exact", "math"                 a built-in kind (verifiers.py)
    "pkg.module:function"           a function imported by module path (on sys.path)
    "path/to/reward.py:function"    a function loaded from a file (verl's custom_reward_function
                                    form); the part before ':' is a file when it ends in ".py" or
                                    contains a '/'. A relative path is made absolute against the
                                    current directory when the config is read (`absolute_spec`).

Every error names the config key the spec came from ('reward.kind', 'reward.by_source.<source>')
and what was expected, in one line. Only user code is imported here, never model text.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys

from megatron_dppo.rewards.verifiers import BUILTIN_KINDS

_FORMS = f"one of {sorted(BUILTIN_KINDS)}, 'pkg.module:function' or 'path/to/file.py:function'"


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _split(spec: str, key: str) -> tuple[str, str]:
    """spec -> (module path or file path, attribute path); ValueError naming key if malformed."""
    target, sep, attr = BUILTIN_KINDS.get(spec, spec).rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not target.strip() or not attr.strip() or " " in attr:
        raise ValueError(f"config key {key!r}: expected {_FORMS}, got {spec!r}")
    return target, attr


def is_file_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def absolute_spec(spec: str, key: str = "reward.kind") -> str:
    """The spec with a relative file path made absolute (against the current directory), after
    checking its form and that the file exists: the config stores it this way, so a resumed run
    or a worker in another directory loads the same file."""
    target, attr = _split(spec, key)
    if spec in BUILTIN_KINDS or not is_file_target(target):
        return spec
    return f"{_existing_file(target, spec, key)}:{attr}"


def _existing_file(target: str, spec: str, key: str) -> str:
    path = os.path.abspath(os.path.expanduser(target))
    if not os.path.isfile(path):
        raise ValueError(f"config key {key!r}: reward file {path!r} not found (from {spec!r})")
    return path


def describe_spec(spec: str) -> str:
    """A spec in words, for a message: "reward file '/abs/r.py' (function 'fn')", "module 'pkg.mod'
    (function 'fn')" or "the built-in kind 'math'"."""
    if spec in BUILTIN_KINDS:
        return f"the built-in kind {spec!r}"
    target, _, attr = spec.rpartition(":")
    return f"{'reward file' if is_file_target(target) else 'module'} {target!r} (function {attr!r})"


def batched_specs(specs, batched: bool) -> set[str]:
    """The specs reward.batched applies to: the user functions (not the built-in kinds). A
    ValueError naming the key when batched is set and there are none."""
    chosen = {spec for spec in specs if batched and spec not in BUILTIN_KINDS}
    if batched and not chosen:
        raise ValueError(
            f"config key 'reward.batched': expected false when every reward kind is built in "
            f"({sorted(set(specs))}): only a user function can take a batch"
        )
    return chosen


def _load_file(path: str):
    """The module of a reward file, executed once per process under a name unique to its path
    (registered in sys.modules, so that classes it defines pickle and dataclasses work)."""
    name = "megatron_dppo_user_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_target(target: str, spec: str, key: str):
    if is_file_target(target):
        path = _existing_file(target, spec, key)
        try:
            return _load_file(path)
        except Exception as e:
            raise ValueError(f"config key {key!r}: loading reward file {path!r} raised {_one_line(e)}") from None
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        missing = e.name or target
        raise ValueError(f"config key {key!r}: cannot import module {missing!r} (from {spec!r}): {e}") from None
    except Exception as e:
        raise ValueError(
            f"config key {key!r}: importing module {target!r} (from {spec!r}) raised {_one_line(e)}"
        ) from None


def resolve_reward_fn(spec: str, key: str = "reward.kind"):
    """A spec (module docstring) -> the callable; ValueError naming `key` when it cannot be had."""
    target, attr = _split(spec, key)
    obj = _import_target(target, spec, key)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"config key {key!r}: {target!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"config key {key!r}: {spec!r} is a {type(obj).__name__}, expected a function")
    return obj


def data_source_of(record) -> str:
    """A record's data_source ('' when it has none): data.PromptRecord's field, or a dict's key."""
    source = getattr(record, "data_source", None)
    if source is None and isinstance(record, dict):
        source = record.get("data_source")
    return "" if source is None else str(source)
