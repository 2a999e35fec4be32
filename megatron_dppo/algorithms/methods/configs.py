"""Config sections of BPPO, ReCo, AdaPrefix-GRPO and SSOPD (docs/methods.md sections 1-4).

Torch-free on purpose: megatron_dppo/config/ imports only choices.py at module level ("imports
nothing, so config parsing stays fast") and can nest these as fields, e.g.
`AlgorithmConfig.bppo: BPPOConfig = field(default_factory=BPPOConfig)`, then call
`cfg.algorithm.bppo.validate("algorithm.bppo")` from `validate`. Each `validate(prefix)` raises a
one-line ValueError in config/checks.py's own format, naming `<prefix>.<field>`. The defaults are
docs/methods.md's "(our choice)" values: none of the papers' hyperparameters could be read.
The Literal choices are declared here; they can move to choices.py when the lead wires them in.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import Literal

BPPOPrefixMode = Literal["pair_min", "ratio", "fixed"]
BPPOClassWeight = Literal["none", "count"]
BPPOSchedule = Literal["off", "waves"]
ReCoResponseWeight = Literal["expected", "count", "none"]
ReCoTokenScale = Literal["gini", "bernoulli", "var_ratio", "none"]
SSOPDDivergence = Literal["fkl_clip", "fkl", "jsd", "rkl_sampled"]
SSOPDFrontier = Literal["variance", "indicator"]
SSOPDWrongPool = Literal["all", "terminated"]


def _check(prefix: str, section, rows) -> None:
    """rows: (field, ok, expected). Literal fields are checked from their annotations first."""
    hints = typing.get_type_hints(type(section))
    for f in fields(section):
        if typing.get_origin(hints[f.name]) is Literal:
            choices = typing.get_args(hints[f.name])
            if getattr(section, f.name) not in choices:
                raise ValueError(
                    f"config key '{prefix}.{f.name}': expected one of {choices}, got {getattr(section, f.name)!r}"
                )
    for name, ok, expected in rows:
        if not ok:
            raise ValueError(f"config key '{prefix}.{name}': expected {expected}, got {getattr(section, name)!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class BPPOConfig:
    """BPPO (docs/methods.md section 1). Every default is our choice: the paper's are unknown."""

    prefix_mode: BPPOPrefixMode = "pair_min"  # pair_min: P_c = P_w = min(L_c, L_w); ratio; fixed
    prefix_ratio: float = 0.5  # alpha of prefix_mode=ratio: P_i = ceil(alpha * L_i), in (0, 1] (our choice)
    prefix_fixed: int = 64  # K of prefix_mode=fixed: P_i = min(K, L_i) (our choice)
    max_ratio: float = 1.0  # extra cap P_i <= ceil(max_ratio * L_i), in (0, 1]; 1 = none (our choice)
    class_weight: BPPOClassWeight = "none"  # count: weight c by k and w by G - k (our choice)
    schedule: BPPOSchedule = "off"  # waves: draw g0 completions at a time until mixed (our reading)
    wave_size: int = 4  # g0 of schedule=waves
    max_group_size: int = 0  # G_max of schedule=waves; 0 = rollout.group_size

    def validate(self, prefix: str = "algorithm.bppo") -> BPPOConfig:
        _check(
            prefix,
            self,
            [
                ("prefix_ratio", 0 < self.prefix_ratio <= 1, "a number in (0, 1]"),
                ("prefix_fixed", _is_int(self.prefix_fixed) and self.prefix_fixed >= 1, "an integer >= 1"),
                ("max_ratio", 0 < self.max_ratio <= 1, "a number in (0, 1] (1 = no extra cap)"),
                ("wave_size", _is_int(self.wave_size) and self.wave_size >= 2, "an integer >= 2"),
                (
                    "max_group_size",
                    _is_int(self.max_group_size) and (self.max_group_size == 0 or self.max_group_size >= 2),
                    "0 (= rollout.group_size) or an integer >= 2",
                ),
            ],
        )
        return self


@dataclass
class ReCoConfig:
    """ReCo (docs/methods.md section 2). The forms are guesses from the abstract; 'none' of either
    option turns that half off (our addition, for ablations)."""

    response_weight: ReCoResponseWeight = "expected"  # u_i = 1 / max(1, G pi_b(o_i|x)); count: 1 / #duplicates
    token_scale: ReCoTokenScale = "gini"  # c_t = g_t / mean g, g = 1 - sum_v pi_old(v)^2
    renorm: bool = False  # u_i <- u_i * G / sum_j u_j per group

    def validate(self, prefix: str = "algorithm.reco") -> ReCoConfig:
        _check(prefix, self, [("renorm", isinstance(self.renorm, bool), "true or false")])
        return self


@dataclass
class AdaPrefixConfig:
    """AdaPrefix-GRPO (docs/methods.md section 3). p* = 0.5 is the paper's ("near 50%"); the
    controller's form, f0, eta, the EMA and the withdrawal schedule are our choices."""

    f0: float = 0.0  # initial fraction of the reference solution shown (our choice)
    target: float = 0.5  # p*: the success rate the controller holds
    eta: float = 0.5  # f <- f + eta * (p* - p_hat): a 0/G visit adds 0.25 of the solution
    ema: float = 0.0  # beta of an EMA of p_hat over visits; 0 = this visit's p_hat (docs/methods.md 3.1.6: 0.5)
    withdraw_start: float = 0.5  # f_max(t) = 1 before this fraction of the run's steps...
    withdraw_end: float = 0.8  # ...falling linearly to 0 here, then 0 (plain GRPO)
    answer_margin_steps: int = 1  # the prefix stops this many steps before the line holding the answer
    boundaries: str = "\n"  # characters ending a step: a prefix is cut right after a token ending in one

    def validate(self, prefix: str = "curriculum.adaprefix") -> AdaPrefixConfig:
        _check(
            prefix,
            self,
            [
                ("f0", 0 <= self.f0 <= 1, "a fraction in [0, 1]"),
                ("target", 0 < self.target < 1, "a success rate in (0, 1)"),
                ("eta", self.eta > 0, "a number > 0"),
                ("ema", 0 <= self.ema < 1, "a number in [0, 1) (0 = this visit only)"),
                ("withdraw_start", 0 <= self.withdraw_start <= 1, "a fraction of the run in [0, 1]"),
                (
                    "withdraw_end",
                    self.withdraw_start <= self.withdraw_end <= 1,
                    f"a fraction in [withdraw_start={self.withdraw_start}, 1]",
                ),
                (
                    "answer_margin_steps",
                    _is_int(self.answer_margin_steps) and self.answer_margin_steps >= 0,
                    "an integer >= 0",
                ),
                ("boundaries", isinstance(self.boundaries, str) and self.boundaries != "", "a non-empty string"),
            ],
        )
        return self


@dataclass
class SSOPDConfig:
    """SSOPD (docs/methods.md section 4). fkl_clip with tau = 0.05 is [3rd]; the frontier weight's
    form, lambda, the templates and every length rule are our choices. The teacher is always the
    current policy under stop-gradient [3rd]; docs/methods.md 4.1.3's `fixed` (initial policy) and `ema` teachers are
    not built (docs/algorithm.md section 6), so there is no key to choose one."""

    coef: float = 1.0  # lambda: L = L_GRPO + lambda * L_aux (sweep 0.1, 0.3, 1.0)
    div: SSOPDDivergence = "fkl_clip"  # per-position divergence d_t
    tau: float = 0.05  # fkl_clip's pointwise clip
    jsd_beta: float = 0.5  # jsd's mixture weight of the teacher (OPSD code default)
    topk: int = 0  # restrict p and q to the teacher's top-k tokens, renormalised; 0 = full vocabulary
    frontier: SSOPDFrontier = "variance"  # omega = 4 p (1 - p); indicator = 1[0 < k < G]
    wrong_pool: SSOPDWrongPool = "all"  # terminated: longest EOS-terminated wrong one, else any
    min_correct_len: int = 0  # skip the aux term when the shortest correct is shorter than this
    aux_max_len: int = 0  # T_q = min(L_w*, aux_max_len); 0 = all of L_w*
    min_positions: int = 16  # skip the pair when fewer positions fit the context
    solution_header: str = "\n\nHere is a correct solution:\n"  # inserted after the problem (our choice)
    instruction: str = "\n\nAfter reading it, solve the problem again in your own words.\n"  # (our choice)

    def validate(self, prefix: str = "aux.ssopd") -> SSOPDConfig:
        _check(
            prefix,
            self,
            [
                ("coef", self.coef >= 0, "a number >= 0"),
                ("tau", self.tau > 0, "a number > 0"),
                ("jsd_beta", 0 < self.jsd_beta < 1, "a number in (0, 1)"),
                ("topk", _is_int(self.topk) and self.topk >= 0, "an integer >= 0 (0 = full vocabulary)"),
                ("min_correct_len", _is_int(self.min_correct_len) and self.min_correct_len >= 0, "an integer >= 0"),
                ("aux_max_len", _is_int(self.aux_max_len) and self.aux_max_len >= 0, "an integer >= 0 (0 = all)"),
                ("min_positions", _is_int(self.min_positions) and self.min_positions >= 1, "an integer >= 1"),
            ],
        )
        return self
