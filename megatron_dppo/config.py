"""Run configuration: plain dataclasses, loaded from YAML with dotted command-line overrides.

    megatron-dppo train --config examples/tiny/addition.yaml trainer.max_steps=5 pruning.r_q=0.5

An unknown key or a value of the wrong type is a ValueError naming the key; the resolved config
is saved with the run (runs/<name>/config.yaml).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field

import yaml


@dataclass
class ModelConfig:
    hf_dir: str = ""                 # HF model dir (config.json, tokenizer, safetensors)
    init_checkpoint: str = ""        # optional: a converted Megatron checkpoint to start from
    dtype: str = "float32"           # float32 | bfloat16
    attention: str = "auto"          # auto | te | local


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    rollout_tp: int = 1              # vLLM tensor_parallel_size (1 = one engine per rank)
    distributed_optimizer: bool | None = None  # None: on with CUDA
    recompute: str = "none"          # activation recomputation: none | selective | full
    # The cluster, for `megatron-dppo plan` and the launch scripts (the trainer reads the
    # world size from torchrun).
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0


@dataclass
class DataConfig:
    train: str = ""                  # JSONL or Parquet
    eval: str = ""
    train_size: int = 0              # use the first N training prompts (0 = all)
    prompt_mode: str = "raw"         # raw | chat (the tokenizer's chat template)
    system_prompt: str = ""


@dataclass
class RolloutConfig:
    group_size: int = 8              # G completions per prompt
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    max_model_len: int = 1024
    kv_cache_gb: float = 0.25        # CPU KV cache (vLLM reserves ~90% of RAM otherwise)
    gpu_memory_utilization: float = 0.5
    dtype: str = ""                  # vLLM dtype; "" = the model's dtype
    sleep_level: int = 1             # GPU: free vLLM memory while training (1 offloads weights, 2 drops them)


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"          # grpo | drgrpo
    loss_agg: str = "token-mean"     # seq-mean-token-mean | token-mean | seq-mean-token-sum-norm
    clip_low: float = 0.2
    clip_high: float = 0.2           # DAPO clip-higher: 0.28
    ratio_type: str = "token"        # token | sequence (GSPO)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    dynamic_sampling: bool = False   # DAPO: drop zero-variance groups, over-sample to refill
    max_resample_rounds: int = 3


@dataclass
class PruningConfig:
    strategy: str = "none"           # none | dppo | reverse | cppo | greso
    r_q: float = 0.0                 # prompt-level ratio (before rollout)
    r_o: float = 0.0                 # completion-level ratio (after rollout)
    drop_zero_variance: bool | None = None  # None: on when kl_coef == 0 (exact then)
    history_ema: float = 0.0


@dataclass
class RewardConfig:
    kind: str = "exact"              # exact | math | "pkg.module:function"
    timeout_s: float = 5.0
    num_workers: int = 2


@dataclass
class OptimConfig:
    """Adam + LR schedule of the policy (megatron_dppo.megatron.step uses it as is)."""
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_steps: int = 0             # 0: the run's optimizer steps (max_steps x minibatches_per_step)
    decay_style: str = "constant"    # constant | linear | cosine


@dataclass
class TrainerConfig:
    run_name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    max_steps: int = 100
    max_time_s: float = 0.0          # 0 = no wall-clock budget
    prompts_per_step: int = 32       # B
    minibatches_per_step: int = 1    # optimizer steps per rollout batch (whole prompt groups)
    max_tokens_per_microbatch: int = 4096
    packing: str = "window"          # window | ffd | padded
    pack_window: int = 16
    eval_every: int = 10
    eval_size: int = 200
    save_every: int = 0              # 0 = only at the end
    keep_checkpoints: int = 2
    threads: int = 0                 # torch threads; 0 = leave as is


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: str = "offline"           # offline | online | disabled
    wandb_project: str = "megatron-dppo"
    progress: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    pruning: PruningConfig = field(default_factory=PruningConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


_CHOICES = {
    "model.dtype": ("float32", "bfloat16"), "model.attention": ("auto", "te", "local"),
    "data.prompt_mode": ("raw", "chat"), "algorithm.advantage": ("grpo", "drgrpo"),
    "algorithm.loss_agg": ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"),
    "algorithm.ratio_type": ("token", "sequence"), "algorithm.kl_estimator": ("k1", "k3"),
    "pruning.strategy": ("none", "dppo", "reverse", "cppo", "greso"),
    "trainer.packing": ("window", "ffd", "padded"), "logging.wandb": ("offline", "online", "disabled"),
    "optim.decay_style": ("constant", "linear", "cosine"),
    "parallel.recompute": ("none", "selective", "full"),
}


def _coerce(key: str, value, typ):
    """Check value against the dataclass field type; ints are accepted for floats."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ValueError:
                pass
        raise ValueError(f"config key {key!r}: expected {typ}, got {value!r}")
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ in (int, str, bool) and type(value) is typ:
        return value
    raise ValueError(f"config key {key!r}: expected {getattr(typ, '__name__', typ)}, got {value!r} "
                     f"({type(value).__name__})")


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
        else:
            setattr(obj, k, _coerce(key, v, hints[k]))


def validate(cfg: Config) -> Config:
    for key, choices in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            raise ValueError(f"config key {key!r}: expected one of {choices}, got {value!r}")
    checks = [
        ("rollout.group_size", cfg.rollout.group_size >= 2, "an integer >= 2"),
        ("pruning.r_q", 0 <= cfg.pruning.r_q < 1, "a number in [0, 1)"),
        ("pruning.r_o", 0 <= cfg.pruning.r_o < 1, "a number in [0, 1)"),
        ("trainer.prompts_per_step", cfg.trainer.prompts_per_step >= 1, "an integer >= 1"),
        ("trainer.minibatches_per_step",
         cfg.trainer.minibatches_per_step >= 1 and cfg.trainer.prompts_per_step % cfg.trainer.minibatches_per_step == 0,
         "an integer >= 1 that divides trainer.prompts_per_step"),
        ("trainer.max_tokens_per_microbatch", cfg.trainer.max_tokens_per_microbatch >= 1, "an integer >= 1"),
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens >= 1, "an integer >= 1"),
        ("rollout.temperature", cfg.rollout.temperature > 0, "a number > 0 (RL samples)"),
        ("parallel.tp", cfg.parallel.tp >= 1, "an integer >= 1"),
        ("parallel.pp", cfg.parallel.pp >= 1, "an integer >= 1"),
        ("model.hf_dir", bool(cfg.model.hf_dir), "a path to a HF model directory"),
        ("data.train", bool(cfg.data.train), "a path to a JSONL or Parquet prompt file"),
    ]
    for key, ok, expected in checks:
        if not ok:
            section, name = key.split(".")
            raise ValueError(f"config key {key!r}: expected {expected}, got "
                             f"{getattr(getattr(cfg, section), name)!r}")
    return cfg


def check_layout(cfg: Config, *, world_size: int, num_heads: int, num_kv_heads: int, num_layers: int) -> None:
    """The parallel layout against the world and the model: ValueError naming every key to change.
    Shared by the trainer (world = torchrun's) and `megatron-dppo plan` (world = nodes x gpus_per_node)."""
    par, problems = cfg.parallel, []
    tp, pp, rtp = par.tp, par.pp, par.rollout_tp
    if world_size % (tp * pp):
        problems.append(f"parallel.tp x parallel.pp = {tp} x {pp} does not divide the world size {world_size}")
    if num_heads % tp or num_kv_heads % tp:
        problems.append(f"parallel.tp={tp} must divide num_attention_heads {num_heads} and "
                        f"num_key_value_heads {num_kv_heads}")
    if num_layers % pp:
        problems.append(f"parallel.pp={pp} must divide num_hidden_layers {num_layers}")
    if tp > par.gpus_per_node:
        problems.append(f"parallel.tp={tp} > parallel.gpus_per_node={par.gpus_per_node}: tensor parallelism "
                        "stays inside a node")
    # vLLM shards query heads evenly, and KV heads evenly or replicated (tp a multiple of them).
    kv_ok = num_kv_heads % rtp == 0 if num_kv_heads >= rtp else rtp % num_kv_heads == 0
    if rtp < 1 or world_size % rtp or num_heads % rtp or not kv_ok:
        problems.append(f"parallel.rollout_tp={rtp} must divide the world size {world_size} and "
                        f"num_attention_heads {num_heads}, and divide (or be a multiple of) "
                        f"num_key_value_heads {num_kv_heads}")
    if rtp > par.gpus_per_node:
        problems.append(f"parallel.rollout_tp={rtp} > parallel.gpus_per_node={par.gpus_per_node}: one vLLM "
                        "engine stays inside a node")
    if problems:
        raise ValueError("invalid parallel layout: " + "; ".join(problems))


def parse_override(text: str):
    """'a.b=value' -> (['a', 'b'], value parsed as YAML)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def load_config(path: str | None = None, overrides=(), check: bool = True) -> Config:
    cfg = Config()
    if path:
        with open(path) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {e}") from e
        try:
            _apply(cfg, data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    for text in overrides:
        key, value = parse_override(text)
        nested: dict = value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        _apply(cfg, nested)
    return validate(cfg) if check else cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
