"""Run configuration: plain dataclasses, loaded from YAML with dotted command-line overrides.

    megatron-dppo train --config examples/tiny/addition.yaml trainer.max_steps=5 pruning.r_q=0.5

An unknown key or a value of the wrong type is a ValueError naming the key; the resolved config
is saved with the run (runs/<name>/config.yaml).

schema   the sections as dataclasses
load     YAML + overrides -> Config (apply_overrides), save_config
checks   validate (one row per key), inert_keys
layout   check_layout, model_layout_problems (what divides what), layout_choices
resolve  resolve, resolve_gpu_settings (model/machine/data-dependent values)
"""

from megatron_dppo.config.checks import inert_keys, validate
from megatron_dppo.config.layout import check_layout, layout_choices, model_layout_problems
from megatron_dppo.config.load import apply_overrides, load_config, parse_override, save_config, to_dict
from megatron_dppo.config.resolve import resolve, resolve_gpu_settings
from megatron_dppo.config.schema import (
    AlgorithmConfig,
    Config,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PruningConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PruningConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "apply_overrides",
    "check_layout",
    "inert_keys",
    "layout_choices",
    "load_config",
    "model_layout_problems",
    "parse_override",
    "resolve",
    "resolve_gpu_settings",
    "save_config",
    "to_dict",
    "validate",
]
