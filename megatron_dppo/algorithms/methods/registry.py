"""Every method the step can run, by slot: the config's `algorithm.<slot>` names one of each.

A new method is one folder (algorithms/methods/<name>/, with its rules and a class overriding
its slot's hooks: algorithms/methods/base.py) and one line below; docs/methods.md, "Adding a
method", walks through one. The pruning strategies (DPPO, CPPO, GRESO ...) have their own
registry, algorithms/pruning.STRATEGIES.
"""

from __future__ import annotations

from megatron_dppo.algorithms.methods.adaprefix.method import AdaPrefix
from megatron_dppo.algorithms.methods.base import AuxLoss, Curriculum, Option, Recipe, Reweighting, Selection
from megatron_dppo.algorithms.methods.bppo.method import BPPO
from megatron_dppo.algorithms.methods.reco.method import ReCo
from megatron_dppo.algorithms.methods.ssopd.method import SSOPD

# slot (the algorithm.* key) -> {its value: the class of hooks}; the first is the plain step's
SLOTS: dict[str, dict[str, type[Option]]] = {
    "selection": {"all": Selection, "bppo": BPPO},
    "reweighting": {"none": Reweighting, "reco": ReCo},
    "curriculum": {"none": Curriculum, "adaprefix": AdaPrefix},
    "aux": {"none": AuxLoss, "ssopd": SSOPD},
}


def recipe(algorithm) -> Recipe:
    """The options `algorithm` (config.AlgorithmConfig) chose, one object per slot."""
    chosen = {}
    for slot, options in SLOTS.items():
        name = getattr(algorithm, slot)
        if name not in options:
            raise ValueError(f"config key 'algorithm.{slot}': expected one of {sorted(options)}, got {name!r}")
        chosen[slot] = options[name](algorithm)
    return Recipe(**chosen)


def slot_of(name: str) -> str | None:
    """The slot whose options include the method `name` (None: no slot has it, e.g. "grpo")."""
    return next((slot for slot, options in SLOTS.items() if name in list(options)[1:]), None)


def check(cfg, strategy) -> None:
    """Every method's config errors: each option's own section (chosen or not), then the chosen
    options with the rest of the config."""
    chosen = recipe(cfg.algorithm)
    for slot, options in SLOTS.items():
        for cls in options.values():
            cls.check_section(cfg, chosen=type(getattr(chosen, slot)) is cls)
    for option in chosen.options():
        option.check(cfg, strategy, chosen)


def inert_keys(cfg) -> dict[str, str]:
    """The keys the chosen methods make inert: the sections of the options not chosen, and what
    each chosen option names itself."""
    a, out = cfg.algorithm, {}
    chosen = recipe(a)
    for slot, options in SLOTS.items():
        mine = type(getattr(chosen, slot))
        for name, cls in options.items():
            if cls.section and cls is not mine:
                out[f"algorithm.{cls.section}"] = (
                    f"algorithm.{slot}={getattr(a, slot)} (algorithm.{cls.section}.* act with algorithm.{slot}={name})"
                )
    for option in chosen.options():
        out.update(option.inert_keys(cfg))
    return out
