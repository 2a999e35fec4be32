"""Every config field does something (issue 27, item 3): one that no code outside the config
modules reads fails here, and one that has no effect under the chosen method is named in the
start-up warning (preflight.config_warnings, from config.inert_keys)."""

import ast
import copy
import dataclasses
import pathlib
import typing

import pytest

from megatron_dppo.algorithms.methods.registry import SLOTS
from megatron_dppo.config import Config, load_config
from megatron_dppo.train.preflight import config_warnings

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_dppo"
SLOT_KEYS = {f"algorithm.{slot}" for slot in SLOTS}
CONFIG_MODULES = {*(PACKAGE / "config").glob("*.py"), PACKAGE / "algorithms" / "methods" / "configs.py"}


def config_leaves(obj, prefix=""):
    """(dotted key, field name) of every non-section field of a config dataclass, recursively."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from config_leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.name


def names_read_outside_config() -> set[str]:
    """Attribute names and string constants of every module of the package but the config's."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if path in CONFIG_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
            elif isinstance(node, ast.keyword) and node.arg:  # dataclass(**...) / replace(field=...)
                names.add(node.arg)
    return names


def test_every_config_field_is_read_outside_the_config_modules():
    read = names_read_outside_config()
    unread = [key for key, name in config_leaves(Config()) if name not in read]
    assert unread == []


def test_the_field_walk_finds_an_unread_field():
    """The walk can fail: a field added to a section and read nowhere is found."""

    @dataclasses.dataclass
    class Section:
        lr: float = 1.0
        a_field_nobody_reads: int = 0

    read = names_read_outside_config()
    assert [k for k, n in config_leaves(Section()) if n not in read] == ["a_field_nobody_reads"]


def _changed(value, typ):
    """A value of the field's type other than `value` (validity does not matter: nothing validates)."""
    if typing.get_origin(typ) is typing.Literal:
        return next(c for c in typing.get_args(typ) if c != value)
    if value is None and float in typing.get_args(typ):  # float | None: resolved later
        return 60.0
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1 if isinstance(value, int) else value / 2 + 0.125
    if isinstance(value, str):
        return value + "x"
    raise AssertionError(f"no changed value for {value!r}")


def _field_type(cfg, key):
    *sections, name = key.split(".")
    obj = cfg
    for s in sections:
        obj = getattr(obj, s)
    return obj, name, typing.get_type_hints(type(obj))[name]


# GRPO on the tiny task: examples/tiny/addition.yaml is DPPO's.
GRPO = ("pruning.strategy=none", "pruning.r_q=0", "pruning.r_o=0")
# Settings that do nothing under GRPO with the extra keys given, found by reading the code that
# would use them (independent of config.inert_keys): each set alone must be named in the warning.
INERT = [
    ((), "pruning.history_ema"),
    ((), "pruning.r_q"),
    ((), "pruning.r_o"),
    ((), "algorithm.kl_estimator"),  # kl_coef 0
    ((), "algorithm.max_resample_rounds"),  # no dynamic sampling, strategy none does not refill
    ((), "data.solution_key"),  # no curriculum
    ((), "data.system_prompt"),  # raw prompts
    ((), "algorithm.bppo.prefix_mode"),
    ((), "algorithm.reco.renorm"),
    ((), "algorithm.adaprefix.f0"),
    ((), "algorithm.adaprefix.boundaries"),
    ((), "algorithm.ssopd.coef"),
    (("algorithm.selection=bppo",), "algorithm.bppo.prefix_ratio"),  # prefix_mode pair_min
    (("algorithm.selection=bppo",), "algorithm.bppo.prefix_fixed"),
    (("algorithm.selection=bppo",), "algorithm.bppo.wave_size"),  # schedule off
    (("algorithm.aux=ssopd",), "algorithm.ssopd.jsd_beta"),  # div fkl_clip
    (("algorithm.aux=ssopd", "algorithm.ssopd.div=jsd"), "algorithm.ssopd.tau"),
    ((), "algorithm.rollout_correction_cap"),  # rollout_correction none
    ((), "algorithm.rollout_correction_low"),
    ((), "algorithm.rollout_correction_high"),
    (("algorithm.rollout_correction=tis",), "algorithm.rollout_correction_low"),  # a truncation, no mask
    (("algorithm.rollout_correction=seq_mask",), "algorithm.rollout_correction_cap"),  # a mask, no truncation
    ((), "algorithm.rollout_correction_seq_low"),
    ((), "algorithm.rollout_correction_seq_high"),
    (("algorithm.rollout_correction=tis_mask",), "algorithm.rollout_correction_seq_high"),  # a token mask
    (("algorithm.rollout_correction=seq_mask",), "algorithm.rollout_correction_low"),  # a geometric mask
    ((), "trainer.max_staleness"),  # colocated: every rollout has the latest weights
    ((), "rollout.partial"),  # colocated: no weights arrive mid-round
    ((), "rollout.partial_chunk"),  # rollout.partial=false
    (("parallel.rollout_ranks=1",), "rollout.sleep_level"),  # dedicated engines share no device: never asleep
    (("trainer.stall_timeout_s=0",), "trainer.start_timeout_s"),  # no watchdog
    ((), "model.lora.alpha"),  # rank 0: no adapters
    ((), "model.lora.dropout"),
    ((), "model.lora.experts"),
]


@pytest.mark.parametrize("overrides,key", INERT)
def test_a_setting_without_effect_is_named_in_the_warning(overrides, key):
    cfg = load_config("examples/tiny/addition.yaml", [*GRPO, *overrides])
    assert config_warnings(cfg) == []
    obj, name, typ = _field_type(cfg, key)
    setattr(obj, name, _changed(getattr(obj, name), typ))
    lines = config_warnings(cfg)
    assert len(lines) == 1 and lines[0].startswith(f"warning: {key}=") and " is ignored: " in lines[0]


@pytest.mark.parametrize(
    "overrides", [(), ("algorithm.selection=bppo",), ("algorithm.aux=ssopd",), ("algorithm.curriculum=adaprefix",)]
)
def test_settings_that_act_are_not_warned_about(overrides):
    """Every field of a selected method, and every other field: changing one that the config reads
    (the keys outside INERT's for this selection) gives no warning."""
    cfg = load_config("examples/tiny/addition.yaml", [*GRPO, *overrides])
    inert_here = {k for o, k in INERT if set(o) <= set(overrides)} | {"algorithm.bppo.max_group_size"}
    selected = {"algorithm.selection=bppo": "bppo", "algorithm.aux=ssopd": "ssopd"}
    sections = {"bppo", "reco", "adaprefix", "ssopd"} - {selected.get(o) for o in overrides}
    if "algorithm.curriculum=adaprefix" in overrides:
        sections.discard("adaprefix")
        inert_here.discard("data.solution_key")
    for key, _ in config_leaves(cfg):
        if (
            key in inert_here
            or key == "pruning.strategy"
            or key.split(".")[1] in sections
            and key.startswith("algorithm.")
        ):
            continue  # (pruning.strategy: a registry name, no other value to try)
        probe = copy.deepcopy(cfg)
        obj, name, typ = _field_type(probe, key)
        if dataclasses.is_dataclass(getattr(obj, name)) or isinstance(getattr(obj, name), (list, dict, type(None))):
            continue
        if key in SLOT_KEYS:  # a method registry's name: another option of its slot
            setattr(obj, name, next(n for n in SLOTS[name] if n != getattr(obj, name)))
        else:
            setattr(obj, name, _changed(getattr(obj, name), typ))
        assert [w for w in config_warnings(probe) if not w.startswith("note:")] == [], key  # a note informs
