"""BPPO as the step's selection (algorithm.selection=bppo): the pair of each mixed group trains on
its prefixes, over BPPO's own denominator; with schedule=waves a prompt's completions come in waves."""

from __future__ import annotations

import torch

from megatron_dppo.algorithms.methods.base import Selection
from megatron_dppo.algorithms.methods.bppo import rules
from megatron_dppo.algorithms.records import size_runs


class BPPO(Selection):
    name, section = "bppo", "bppo"
    denominator = "bppo"

    def select(self, method, strategy, groups, advantages, generator):
        """Shortest correct + shortest incorrect completion of each mixed group (verdicts before
        reward shaping), trained on their prefixes (Group.trained_tokens); replaces completion pruning."""
        verdicts = torch.tensor([g.correct() for g in groups], dtype=torch.float32)
        lengths = torch.tensor([g.completion_lengths() for g in groups])
        lmax = method.max_new_tokens
        plan = rules.plan(verdicts, lengths, self.cfg, loss_agg=method.loss_agg, max_response_length=lmax)
        for g, prefix in zip(groups, plan.prefix_len.tolist()):
            g.trained_tokens = prefix
        prefix = torch.tensor([g.trained_tokens for g in groups])  # before the overlong filter zeroes any
        return plan.seq_weight > 0, plan.seq_weight.float(), prefix

    def own_denominator(self, method, groups):
        """A sum over groups: over each run of one group size (waves), docs/methods.md 1.1.7."""
        return sum(self._denominator(method, run) for run in size_runs(groups))

    def _denominator(self, method, groups) -> float:
        lengths = torch.tensor([g.loss_lengths() for g in groups], dtype=torch.float64)
        seq_weight = torch.tensor([g.completion_weights for g in groups], dtype=torch.float64)
        weights = torch.tensor([g.train_weight for g in groups], dtype=torch.float64)
        return rules.denominator_terms(
            lengths, seq_weight, method.loss_agg, prompt_weight=weights, max_response_length=method.max_new_tokens
        )

    def metrics(self, parts):
        return rules.step_metrics([p.prefix for p in parts], [p.advantages for p in parts])

    def completions_wanted(self, group, group_size):
        """schedule=waves: g0 at a time until the group is mixed (rules.next_wave), decided on
        BPPO's own verdicts (before reward shaping) as its pair is."""
        if self.cfg.schedule != "waves":
            return super().completions_wanted(group, group_size)
        so_far = [float(c) for c in group.correct()] if group is not None else []
        return rules.next_wave(so_far, self.cfg.wave_size, self.cfg.max_group_size or group_size)

    @classmethod
    def check_section(cls, cfg, chosen):
        super().check_section(cfg, chosen)
        a = cfg.algorithm
        if a.bppo.schedule == "waves" and not chosen:
            raise ValueError(
                "config keys 'algorithm.bppo.schedule' and 'algorithm.selection': waves schedule BPPO's completions, "
                f"so they need algorithm.selection=bppo, got {a.selection!r}"
            )

    def check(self, cfg, strategy, recipe):
        if "r_o" in strategy.ratios and cfg.pruning.r_o > 0:
            raise ValueError(
                f"config keys 'algorithm.selection' and 'pruning.r_o': bppo selects the completions itself "
                f"(completion pruning cannot compose with it), so pruning.r_o must be 0, got {cfg.pruning.r_o}"
            )
        if strategy.denominator == "kept":
            raise ValueError(f"config key 'algorithm.selection': bppo cannot run with pruning.strategy={strategy.name}")
        if recipe.reweighting.enabled:
            raise ValueError(
                "config keys 'algorithm.selection' and 'algorithm.reweighting': bppo trains two completions "
                f"per group, {cfg.algorithm.reweighting} reweights all of them: choose one"
            )
        if self.cfg.schedule == "waves":
            self._check_waves(cfg, strategy, recipe)

    def _check_waves(self, cfg, strategy, recipe) -> None:
        """Waves give each prompt its own group size: what reads a group's size as G cannot run."""
        bc, group_size = self.cfg, cfg.rollout.group_size
        if bc.wave_size > (bc.max_group_size or group_size):
            raise ValueError(
                f"config key 'algorithm.bppo.wave_size': a wave of {bc.wave_size} is more than the group's most "
                f"completions (algorithm.bppo.max_group_size, or rollout.group_size={group_size})"
            )
        if bc.max_group_size > group_size:
            raise ValueError(
                f"config key 'algorithm.bppo.max_group_size': {bc.max_group_size} is more than "
                f"rollout.group_size={group_size} (the engine's KV cache and the plan are sized by it)"
            )
        for key, refused, why in [
            ("algorithm.aux", recipe.aux.enabled, f"{cfg.algorithm.aux}'s pairs"),
            ("pruning.strategy", bool(strategy.one_group_size), strategy.one_group_size),
            ("algorithm.curriculum", recipe.curriculum.enabled, "the curriculum's success rate per visit"),
        ]:
            if refused:
                raise ValueError(
                    f"config keys 'algorithm.bppo.schedule' and '{key}': waves give each prompt its own group size, "
                    f"which {why} do not take yet"
                )

    def inert_keys(self, cfg):
        bc, out = self.cfg, {}
        for name, mode in (("prefix_ratio", "ratio"), ("prefix_fixed", "fixed")):
            if bc.prefix_mode != mode:
                out[f"algorithm.bppo.{name}"] = (
                    f"algorithm.bppo.prefix_mode={bc.prefix_mode} (it acts with prefix_mode={mode})"
                )
        if bc.schedule != "waves":
            for name in ("wave_size", "max_group_size"):
                out[f"algorithm.bppo.{name}"] = f"algorithm.bppo.schedule={bc.schedule} (it acts with schedule=waves)"
        return out
