"""Reward specs: a built-in kind or 'pkg.module:function' -> the callable."""

from __future__ import annotations

import importlib

from megatron_dppo.rewards.verifiers import BUILTIN_KINDS


def resolve_reward_fn(spec: str):
    """'pkg.module:function' (or a built-in kind) -> the callable. Imports user code, never model text."""
    spec = BUILTIN_KINDS.get(spec, spec)
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(
            f"reward kind must be one of {sorted(BUILTIN_KINDS)} or an import path 'pkg.module:function', got {spec!r}"
        )
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r} is not callable")
    return obj
