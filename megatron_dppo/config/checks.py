"""Every check that needs only the config itself, one row per key, and the keys a config sets that
its method does not read."""

from __future__ import annotations

from megatron_dppo.config.schema import RECOMPUTE_MODULES, Config, RewardConfig


def validate(cfg: Config) -> Config:
    """Every check that needs only the config itself, each naming its key(s). Checks that need the
    model or the world size are in `check_layout` and `resolve`. (Long because it is one table,
    a row per key, kept together so that every key's rule is found in one place.)"""
    from megatron_dppo.algorithms.pruning import STRATEGIES  # the strategy registry
    from megatron_dppo.run.run_dir import run_name_problem

    c, t, r, a, o = cfg, cfg.trainer, cfg.rollout, cfg.algorithm, cfg.optim
    c.model.lora.validate("model.lora")
    checks = [
        ("model.hf_dir", bool(c.model.hf_dir), "a path to a HF model directory"),
        (
            "parallel.sequence_parallel",
            not (c.model.lora.rank and c.parallel.sequence_parallel),
            "false with model.lora.rank > 0 (the adapters see each linear's whole input; sequence parallelism "
            "needs Transformer Engine's linears)",
        ),
        (
            "model.init_checkpoint",
            not (c.model.lora.rank and c.model.init_checkpoint),
            "no value with model.lora.rank > 0 (the frozen base is model.hf_dir: convert a checkpoint to an HF "
            "directory with tools/convert_megatron_to_hf.py and name it there)",
        ),
        (
            "model.attention",
            not (c.model.lora.rank and c.model.attention == "te"),
            "auto or local with model.lora.rank > 0 (the adapters sit on Megatron-Core's own linears; Transformer "
            "Engine's fuse the input norm into linear_qkv and linear_fc1)",
        ),
        ("data.train", bool(c.data.train), "a path (or a list of paths) to .jsonl / .parquet files or datasets dirs"),
        ("data.train_size", c.data.train_size >= 0, "an integer >= 0 (0 = all)"),
        (
            "data.chat_template_kwargs",
            not c.data.chat_template_kwargs or c.data.prompt_mode == "chat",
            "no entries unless data.prompt_mode=chat (raw mode applies no template)",
        ),
        ("pruning.strategy", c.pruning.strategy in STRATEGIES, f"one of {sorted(STRATEGIES)}"),
        ("pruning.r_q", 0 <= c.pruning.r_q < 1, "a number in [0, 1)"),
        ("pruning.r_o", 0 <= c.pruning.r_o < 1, "a number in [0, 1)"),
        ("pruning.history_ema", 0 <= c.pruning.history_ema < 1, "a number in [0, 1) (0 = last value)"),
        ("rollout.group_size", r.group_size >= 2, "an integer >= 2"),
        ("rollout.max_new_tokens", r.max_new_tokens >= 1, "an integer >= 1"),
        ("rollout.partial_chunk", r.partial_chunk >= 1, "an integer >= 1 (tokens between looks for new weights)"),
        (
            "rollout.partial",
            not (r.partial and c.parallel.rollout_tp > 1),
            "false with parallel.rollout_tp > 1 (the ranks of one engine would have to agree on the chunk where new "
            "weights load: not built)",
        ),
        (
            "rollout.partial",
            not (r.partial and r.routing_replay),
            "false with rollout.routing_replay=true (a completion's routed experts across a weight switch: not built)",
        ),
        (
            "rollout.partial",
            not (r.partial and r.stop),
            "false with rollout.stop strings (a stop string across a chunk boundary would be missed: not built)",
        ),
        (
            "rollout.max_model_len",
            r.max_model_len > r.max_new_tokens,
            f"an integer > rollout.max_new_tokens ({r.max_new_tokens}): prompt + completion must fit",
        ),
        ("rollout.temperature", r.temperature > 0, "a number > 0 (RL samples)"),
        ("rollout.top_p", 0 < r.top_p <= 1, "a number in (0, 1]"),
        ("rollout.top_k", r.top_k >= 0, "an integer >= 0 (0 = all tokens)"),
        ("rollout.stop", all(r.stop), "a list of non-empty strings"),
        ("rollout.kv_cache_gb", r.kv_cache_gb > 0, "a number > 0"),
        ("rollout.gpu_memory_utilization", 0 < r.gpu_memory_utilization <= 1, "a number in (0, 1]"),
        ("rollout.sleep_level", r.sleep_level in (1, 2), "1 or 2"),
        ("algorithm.clip_low", 0 <= a.clip_low < 1, "a number in [0, 1)"),
        ("algorithm.clip_high", a.clip_high >= 0, "a number >= 0"),
        ("algorithm.kl_coef", a.kl_coef >= 0, "a number >= 0"),
        ("algorithm.rollout_correction_cap", a.rollout_correction_cap >= 1, "a number >= 1 (the largest weight)"),
        ("algorithm.rollout_correction_low", 0 <= a.rollout_correction_low <= 1, "a number in [0, 1]"),
        (
            "algorithm.rollout_correction_high",
            a.rollout_correction_high >= 1,
            "a number >= 1 (ratios above it are masked)",
        ),
        ("algorithm.rollout_correction_seq_low", 0 <= a.rollout_correction_seq_low <= 1, "a number in [0, 1]"),
        (
            "algorithm.rollout_correction_seq_high",
            a.rollout_correction_seq_high >= 1,
            "a number >= 1 (sequences whose geometric-mean ratio is above it are masked)",
        ),
        ("algorithm.max_resample_rounds", a.max_resample_rounds >= 0, "an integer >= 0"),
        ("algorithm.moe_aux_loss_coeff", a.moe_aux_loss_coeff >= 0, "a number >= 0 (0 = off)"),
        ("algorithm.moe_z_loss_coeff", a.moe_z_loss_coeff >= 0, "a number >= 0 (0 = off)"),
        ("reward.timeout_s", c.reward.timeout_s > 0, "a number of seconds > 0"),
        ("reward.num_workers", c.reward.num_workers >= 1, "an integer >= 1"),
        ("reward.max_error_frac", 0 <= c.reward.max_error_frac <= 1, "a fraction in [0, 1]"),
        (
            "reward.overlong_buffer",
            0 <= c.reward.overlong_buffer < r.max_new_tokens,
            f"an integer in [0, rollout.max_new_tokens={r.max_new_tokens}) (0 = off): the penalty's ramp is "
            "the last overlong_buffer tokens of the generation budget",
        ),
        ("reward.overlong_penalty", c.reward.overlong_penalty >= 0, "a number >= 0"),
        *_eval_checks(c),
        ("optim.lr", o.lr > 0, "a number > 0"),
        ("optim.min_lr", 0 <= o.min_lr <= o.lr, f"a number in [0, optim.lr={o.lr}]"),
        ("optim.weight_decay", o.weight_decay >= 0, "a number >= 0"),
        ("optim.adam_beta1", 0 <= o.adam_beta1 < 1, "a number in [0, 1)"),
        ("optim.adam_beta2", 0 <= o.adam_beta2 < 1, "a number in [0, 1)"),
        ("optim.adam_eps", o.adam_eps > 0, "a number > 0"),
        ("optim.clip_grad", o.clip_grad >= 0, "a number >= 0 (0 = no clipping)"),
        ("optim.warmup_steps", o.warmup_steps >= 0, "an integer >= 0"),
        ("optim.decay_steps", o.decay_steps >= 0, "an integer >= 0 (0 = the run's optimizer steps)"),
        ("trainer.max_steps", t.max_steps >= 1, "an integer >= 1"),
        ("trainer.max_time_s", t.max_time_s >= 0, "a number of seconds >= 0 (0 = no budget)"),
        ("trainer.prompts_per_step", t.prompts_per_step >= 1, "an integer >= 1"),
        (
            "trainer.minibatches_per_step",
            t.minibatches_per_step >= 1 and t.prompts_per_step % t.minibatches_per_step == 0,
            f"an integer >= 1 that divides trainer.prompts_per_step ({t.prompts_per_step})",
        ),
        ("trainer.epochs_per_step", t.epochs_per_step >= 1, "an integer >= 1"),
        (
            "trainer.max_tokens_per_microbatch",
            t.max_tokens_per_microbatch >= r.max_model_len,
            f"an integer >= rollout.max_model_len ({r.max_model_len}), the longest sequence a rollout can "
            "produce: raise it or lower rollout.max_model_len",
        ),
        ("trainer.pack_window", t.pack_window >= 1, "an integer >= 1"),
        ("trainer.eval_every", t.eval_every >= 0, "an integer >= 0 (0 = no evaluation)"),
        ("trainer.eval_size", t.eval_size >= 1, "an integer >= 1"),
        ("trainer.save_every", t.save_every >= 0, "an integer >= 0 (0 = by time only)"),
        ("trainer.save_every_minutes", t.save_every_minutes >= 0, "a number of minutes >= 0 (0 = by steps only)"),
        ("trainer.save_hf_every", t.save_hf_every >= 0, "an integer >= 0 (0 = no HF model dirs)"),
        ("trainer.keep_checkpoints", t.keep_checkpoints >= 1, "an integer >= 1"),
        (
            "trainer.stall_timeout_s",
            t.stall_timeout_s is None or t.stall_timeout_s == 0 or t.stall_timeout_s >= 1,
            "a number of seconds >= 1, or 0 for no stall watchdog",
        ),
        (
            "trainer.start_timeout_s",
            t.start_timeout_s is None or t.start_timeout_s >= 1,
            "a number of seconds >= 1 (start-up without progress; the stall watchdog's own switch is stall_timeout_s)",
        ),
        ("trainer.run_name", run_name_problem(t.run_name) is None, "one plain directory name (no '/', not . or ..)"),
        ("trainer.output_dir", bool(t.output_dir), "a directory path (the run dir is <output_dir>/<run_name>)"),
        ("trainer.threads", t.threads >= 0, "an integer >= 0 (0 = torch's choice)"),
        (
            "trainer.max_staleness",
            isinstance(t.max_staleness, int) and t.max_staleness >= 0,
            "an integer >= 0 (updates a rollout's weights may lag)",
        ),
        ("parallel.tp", c.parallel.tp >= 1, "an integer >= 1"),
        ("parallel.pp", c.parallel.pp >= 1, "an integer >= 1"),
        ("parallel.rollout_tp", c.parallel.rollout_tp >= 1, "an integer >= 1"),
        ("parallel.rollout_ranks", c.parallel.rollout_ranks >= 0, "an integer >= 0 (0 = colocated rollout)"),
        ("parallel.ep", c.parallel.ep >= 1, "an integer >= 1"),
        ("parallel.etp", c.parallel.etp >= 1, "an integer >= 1"),
        ("parallel.timeout_minutes", c.parallel.timeout_minutes > 0, "a number of minutes > 0"),
        (
            "parallel.recompute_modules",
            c.parallel.recompute_modules is None or set(c.parallel.recompute_modules) <= RECOMPUTE_MODULES,
            f"a list of Megatron recompute modules, among {sorted(RECOMPUTE_MODULES)}",
        ),
        ("parallel.nodes", c.parallel.nodes >= 1, "an integer >= 1"),
        ("parallel.gpus_per_node", c.parallel.gpus_per_node >= 1, "an integer >= 1"),
    ]
    for key, ok, expected in checks:
        if not ok:
            section, name = key.split(".")
            raise ValueError(f"config key {key!r}: expected {expected}, got {getattr(getattr(cfg, section), name)!r}")
    _check_reward_specs(c.reward)
    _check_methods(cfg)
    return cfg


def _check_methods(cfg: Config) -> None:
    """The methods' options (docs/methods.md): each method's section and the combinations that
    cannot work, checked by the method itself (algorithms/methods/registry.check)."""
    from megatron_dppo.algorithms.methods import registry
    from megatron_dppo.algorithms.pruning import get_strategy

    registry.check(cfg, get_strategy(cfg.pruning.strategy))


def _check_reward_specs(rc: RewardConfig) -> None:
    """reward.kind and reward.by_source.<source>: each spec's form, its file if it names one (made
    absolute against the current directory, so a resumed run or a worker loads the same file);
    reward.batched needs a user function. Importing the functions is RewardScorer's workers' (under a timeout)."""
    from megatron_dppo.rewards.spec import absolute_spec, batched_specs

    rc.kind = absolute_spec(rc.kind, "reward.kind")
    rc.by_source = {src: absolute_spec(spec, f"reward.by_source.{src}") for src, spec in rc.by_source.items()}
    batched_specs([rc.kind, *rc.by_source.values()], rc.batched)


def _eval_checks(c: Config) -> list[tuple[str, bool, str]]:
    """validate()'s lines for the eval section (a set name becomes part of metric names)."""
    e = c.eval
    return [
        ("eval.n", e.n >= 1, "an integer >= 1"),
        (
            "eval.temperature",
            e.temperature > 0 or (e.temperature == 0 and e.n == 1),
            f"a number > 0, or 0 (greedy) with eval.n=1 (eval.n is {e.n})",
        ),
        ("eval.top_p", 0 < e.top_p <= 1, "a number in (0, 1]"),
        (
            "eval.pass_k",
            bool(e.pass_k) and all(1 <= k <= e.n for k in e.pass_k),
            f"a non-empty list of integers in [1, eval.n={e.n}]",
        ),
        (
            "eval.sets",
            all(name and "/" not in name and name != "all" and path for name, path in e.sets.items()),
            "a mapping of set names (no '/', not 'all') to non-empty paths",
        ),
        (
            "eval.sets",
            not (c.data.eval and "eval" in e.sets),
            f"no set named 'eval' when data.eval is given (data.eval={c.data.eval!r} is the set 'eval')",
        ),
    ]


def _inert_rollout_correction_keys(kind: str) -> dict[str, str]:
    """The rollout correction's bounds that its kind does not read: the cap without a truncation,
    the mask's bounds without a mask (algorithms/losses.rollout_correction)."""
    from megatron_dppo.algorithms.losses import ROLLOUT_SEQ_MASKING, ROLLOUT_TOKEN_MASKING, ROLLOUT_TRUNCATING

    out = {}
    if kind not in ROLLOUT_TRUNCATING:
        out["algorithm.rollout_correction_cap"] = (
            f"algorithm.rollout_correction={kind} truncates no weight (kinds that do: {', '.join(ROLLOUT_TRUNCATING)})"
        )
    if kind not in ROLLOUT_TOKEN_MASKING:
        why = (
            f"algorithm.rollout_correction={kind} masks no token by its own ratio "
            f"(kinds that do: {', '.join(ROLLOUT_TOKEN_MASKING)})"
        )
        out["algorithm.rollout_correction_low"] = out["algorithm.rollout_correction_high"] = why
    if kind not in ROLLOUT_SEQ_MASKING:
        why = (
            f"algorithm.rollout_correction={kind} masks no sequence by its geometric-mean ratio "
            f"(kinds that do: {', '.join(ROLLOUT_SEQ_MASKING)})"
        )
        out["algorithm.rollout_correction_seq_low"] = out["algorithm.rollout_correction_seq_high"] = why
    return out


def inert_keys(cfg: Config) -> dict[str, str]:
    """Keys (or whole sections) that this config's method does not read -> why, the one rule of
    "does this key matter here": the saved config leaves them out (so it shows what ran: a GRPO
    run has no pruning ratios; no KL, no KL estimator), and preflight.config_warnings names each
    one that is set to other than its default. Rules that need the model, tokenizer or data are
    preflight.input_warnings'."""
    from megatron_dppo.algorithms.methods import registry
    from megatron_dppo.algorithms.pruning import STRATEGIES, get_strategy

    a, p = cfg.algorithm, cfg.pruning
    strategy, out = get_strategy(p.strategy), {}
    what = {"r_q": "prunes no prompts", "r_o": "prunes no completions"}
    for r in ("r_q", "r_o"):
        if r not in strategy.ratios:
            users = sorted(n for n, make in STRATEGIES.items() if r in make().ratios)
            out[f"pruning.{r}"] = (
                f"pruning.strategy={p.strategy} {what[r]} (strategies that use pruning.{r}: {', '.join(users)})"
            )
    if not strategy.ratios:  # it prunes nothing, so it reads no history
        out["pruning.history_ema"] = f"pruning.strategy={p.strategy} keeps no prompt history"
    if not (a.dynamic_sampling or strategy.refills):
        out["algorithm.max_resample_rounds"] = (
            f"nothing refills the batch (algorithm.dynamic_sampling=false, pruning.strategy={p.strategy})"
        )
    if a.kl_coef == 0:
        out["algorithm.kl_estimator"] = "algorithm.kl_coef=0 (no KL term)"
    out.update(_inert_rollout_correction_keys(a.rollout_correction))
    out.update(registry.inert_keys(cfg))  # each method names its own
    if cfg.model.lora.rank == 0:
        why = "model.lora.rank=0: no adapters (full fine-tuning)"
        out.update({f"model.lora.{k}": why for k in ("alpha", "dropout", "targets", "experts", "sync")})
    if cfg.trainer.stall_timeout_s == 0:
        out["trainer.start_timeout_s"] = "trainer.stall_timeout_s=0 turns the stall watchdog off"
    if cfg.data.prompt_mode == "raw":
        out["data.system_prompt"] = "data.prompt_mode=raw applies no chat template, so no system turn"
    if cfg.parallel.rollout_ranks:
        out["rollout.sleep_level"] = (
            f"parallel.rollout_ranks={cfg.parallel.rollout_ranks}: dedicated rollout ranks share no device with "
            "training, so their engines never sleep"
        )
    else:
        out["trainer.max_staleness"] = (
            "parallel.rollout_ranks=0: colocated ranks generate and train in turn, so every rollout uses the "
            "latest weights"
        )
    if cfg.rollout.partial and not (cfg.parallel.rollout_ranks and cfg.trainer.max_staleness):
        out["rollout.partial"] = (
            "no new weights arrive during a rollout without dedicated rollout ranks and trainer.max_staleness >= 1"
        )
    if not cfg.rollout.partial:
        out["rollout.partial_chunk"] = "rollout.partial=false"
    if cfg.parallel.recompute != "selective":
        out["parallel.recompute_modules"] = (
            f"parallel.recompute={cfg.parallel.recompute} (it acts with parallel.recompute=selective)"
        )
    return out
