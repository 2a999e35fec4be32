"""DPPO pruning (docs/dppo.md sections 2, 3, 5) and the baseline strategies, in one registry.

Both DPPO levels use the same Horvitz-Thompson machinery: a candidate set C (the
low-information members), a FIXED count m = floor(r * |C|) of them dropped uniformly at
random, and the survivors of C reweighted by |C| / (|C| - m). Every member then has
E[weight * 1{kept}] = 1, so any loss that is a fixed-weight sum over members keeps its
expectation (and its gradient's) equal to the full batch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_dppo.algorithms._checks import check_group_tensor, check_ratio

# |A| <= mean|A| compared with a relative tolerance so exact ties (binary rewards at success
# rate 1/2 make every |A| equal, and the float mean can land a hair below) are candidates.
_REL_TOL = 1e-6
_ABS_TOL = 1e-12
# r * |C| computed in floats can land a hair below an integer (0.29 * 100 = 28.999...).
_FLOOR_SLACK = 1e-9


def _is_low(values: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    return values <= mean * (1 + _REL_TOL) + _ABS_TOL


def _drop_count(ratio: float, num_candidates: torch.Tensor) -> torch.Tensor:
    m = torch.floor(ratio * num_candidates.double() + _FLOOR_SLACK).long()
    # ratio < 1 keeps at least one candidate, so the weight |C| / (|C| - m) stays finite.
    return torch.minimum(m, (num_candidates - 1).clamp(min=0))


def _drop_uniformly(candidates: torch.Tensor, ratio: float, generator: torch.Generator | None):
    """candidates bool [R, N] -> (keep bool [R, N], weight float [R, N]).

    Drops exactly floor(ratio * |C_r|) candidates of each row, uniformly at random.
    """
    num_cand = candidates.sum(dim=1)
    drop_n = _drop_count(ratio, num_cand)
    # A uniformly random order of each row's candidates: random keys, non-candidates last.
    keys = torch.rand(candidates.shape, generator=generator, dtype=torch.float64)
    keys = torch.where(candidates, keys, torch.full_like(keys, 2.0))
    rank = keys.argsort(dim=1).argsort(dim=1)
    dropped = candidates & (rank < drop_n[:, None])
    keep = ~dropped
    survivor_w = num_cand.double() / (num_cand - drop_n).clamp(min=1).double()
    weight = torch.where(candidates, survivor_w[:, None].expand_as(keys), torch.ones_like(keys))
    weight = torch.where(keep, weight, torch.zeros_like(weight))
    return keep, weight.float()


def completion_candidates(advantages: torch.Tensor, rule: str = "low") -> torch.Tensor:
    """Bool [num_prompts, G]: |A| <= group mean |A| ("low", DPPO) or > ("high", reverse)."""
    if rule not in ("low", "high"):
        raise ValueError(f"rule must be 'low' or 'high', got {rule!r}")
    abs_adv = advantages.abs().double()
    low = _is_low(abs_adv, abs_adv.mean(dim=1, keepdim=True))
    return low if rule == "low" else ~low


def prune_completions(
    advantages: torch.Tensor, ratio: float, generator: torch.Generator | None = None, rule: str = "low"
):
    """DPPO completion-level pruning (after rollout, on the full group's advantages).

    advantages float [num_prompts, G] -> keep bool [num_prompts, G], weight float
    [num_prompts, G] (0 where dropped, |C|/(|C|-m) for kept candidates, 1 otherwise).
    """
    check_group_tensor("advantages", advantages)
    ratio = check_ratio("ratio", ratio)
    return _drop_uniformly(completion_candidates(advantages, rule), ratio, generator)


def _check_scores(scores: torch.Tensor) -> torch.Tensor:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a 1-D tensor [num_prompts], got {shape}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a floating-point tensor (NaN = no history), got dtype {scores.dtype}")
    if torch.isinf(scores).any():
        raise ValueError("scores must be finite or NaN (no history): found inf")
    return scores


def prompt_candidates(scores: torch.Tensor, rule: str = "low") -> torch.Tensor:
    """Bool [num_prompts]: prompts with a history whose score is <= (or > for "high") the
    mean score over prompts with a history. Prompts never seen (NaN) are never candidates."""
    if rule not in ("low", "high"):
        raise ValueError(f"rule must be 'low' or 'high', got {rule!r}")
    seen = ~torch.isnan(scores)
    if not seen.any():
        return torch.zeros_like(seen)
    s = scores.double()
    mean = s[seen].mean()
    low = _is_low(torch.where(seen, s, torch.zeros_like(s)), mean)
    return seen & (low if rule == "low" else ~low)


def prune_prompts(scores: torch.Tensor, ratio: float, generator: torch.Generator | None = None, rule: str = "low"):
    """DPPO prompt-level pruning (before rollout: skipped prompts are never generated).

    scores float [num_prompts] (history score H(q), NaN for no history) -> keep bool
    [num_prompts], weight float [num_prompts] (0 skipped, |P|/(|P|-k) kept candidates, else 1).
    """
    _check_scores(scores)
    ratio = check_ratio("ratio", ratio)
    keep, weight = _drop_uniformly(prompt_candidates(scores, rule)[None, :], ratio, generator)
    return keep[0], weight[0]


def drop_zero_variance_groups(advantages: torch.Tensor):
    """Bool [num_prompts]: groups whose advantages are not all zero.

    With no KL term a zero-variance group's loss and gradient are exactly zero, so removing it
    changes nothing (unlike pruning, it needs no reweighting)."""
    check_group_tensor("advantages", advantages)
    return (advantages != 0).any(dim=1)


# ---------------------------------------------------------------------------------------------
# Strategy registry: what each method does at each point of a step. docs/algorithm.md says what
# each baseline is and where it differs from its authors' code.

# GRESO's "easy" and "hard" prompts (Infini-AI-Lab/GRESO, DataProfiler): a rollout whose group
# mean reward is >= 0.98 (all correct) or <= 0.11 (all wrong: their wrong answers score 0.1).
EASY_MEAN = 0.98
HARD_MEAN = 0.11


@dataclass
class PromptStats:
    """The history store's view of one batch of prompts (algorithms/history.py)."""

    score: torch.Tensor  # float [P]; NaN = never rolled out
    zero_var_streak: torch.Tensor  # long [P]; consecutive zero-variance rollouts up to now
    easy_streak: torch.Tensor | None = None  # long [P]; consecutive rollouts with group mean >= EASY_MEAN
    hard_streak: torch.Tensor | None = None  # long [P]; consecutive rollouts with group mean <= HARD_MEAN

    def __post_init__(self):
        n = self.score.shape[0]
        for name in ("zero_var_streak", "easy_streak", "hard_streak"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, torch.zeros(n, dtype=torch.long))
            elif value.shape != (n,):
                raise ValueError(f"PromptStats.{name} must have shape ({n},) like score, got {tuple(value.shape)}")


class PruningStrategy:
    """The interface the trainer calls, with GRPO's answers (prune nothing) as defaults.

    unbiased: the kept sequences are reweighted so the expected loss is the full batch's.
    refills: prompts skipped before rollout are replaced by drawing more (GRESO).
    filters_zero_variance: the method's own pipeline drops zero-variance groups (dynamic sampling).
    denominator: "full" (the unpruned batch's normaliser) or "kept" (what was trained, as CPPO does).
    ratios: the pruning.* ratios the strategy reads (the saved config leaves the others out).
    one_group_size: why the strategy needs every group of a step to have one size ("" = it does
        not), so BPPO's waves (a group size per prompt) cannot run with it.
    """

    name = "none"
    ratios: tuple[str, ...] = ()
    unbiased = True
    refills = False
    filters_zero_variance = False
    denominator = "full"
    one_group_size = ""

    def prompts_to_draw(self, batch_size: int, r_q: float, r_o: float) -> int:
        """Prompts to draw per round (CPPO over-samples so that what survives pruning is ~B*G)."""
        return batch_size

    def prune_prompts(self, stats: PromptStats, ratio: float, generator: torch.Generator | None = None):
        """Before rollout: keep bool [P] and weight float [P] (0 where skipped)."""
        n = stats.score.shape[0]
        return torch.ones(n, dtype=torch.bool), torch.ones(n)

    def prune_completions(self, advantages: torch.Tensor, ratio: float, generator: torch.Generator | None = None):
        """After rollout, on the full groups' advantages [P, G]: keep bool [P, G], weight float [P, G]."""
        check_group_tensor("advantages", advantages)
        return torch.ones_like(advantages, dtype=torch.bool), torch.ones_like(advantages)

    def observe(self, prompt_ids, rewards: torch.Tensor) -> None:
        """Once per step with every group rolled out in it (before any filter)."""
        check_group_tensor("rewards", rewards)
        if len(prompt_ids) != rewards.shape[0]:
            raise ValueError(f"prompt_ids has {len(prompt_ids)} entries but rewards has {rewards.shape[0]} rows")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(
                f"pruning strategy {self.name!r} keeps no state, but the checkpoint has "
                f"{sorted(state)}: was it saved by another strategy?"
            )


NoPruning = PruningStrategy  # GRPO (and DAPO/GSPO/Dr.GRPO): every prompt rolled out, every completion trained


class DPPO(PruningStrategy):
    """Unbiased dynamic pruning: low-information prompts and low-|A| completions, reweighted.
    rule="high" is the reverse ablation (prune the informative ones instead)."""

    name = "dppo"
    ratios = ("r_q", "r_o")

    def __init__(self, rule: str = "low"):
        self.rule = rule
        if rule == "high":
            self.name = "reverse"

    def prune_prompts(self, stats, ratio, generator=None):
        return prune_prompts(stats.score, ratio, generator, rule=self.rule)

    def prune_completions(self, advantages, ratio, generator=None):
        return prune_completions(advantages, ratio, generator, rule=self.rule)


def _floor(x: float) -> int:
    return math.floor(x + _FLOOR_SLACK)


class CPPO(PruningStrategy):
    """CPPO as its verl recipe runs it (lzhxmu/CPPO, cppo_verl/recipe/cppo, metric=smallest,
    allocation=True): draw int(B / (1 - P)) prompts, then keep the int(N * (1 - P)) completions
    with the largest |A| over the WHOLE rolled-out batch of N, no reweighting, and normalise the
    loss over the kept completions. Ties in |A| are broken uniformly at random (ours)."""

    name = "cppo"
    ratios = ("r_o",)
    unbiased = False
    denominator = "kept"

    def prompts_to_draw(self, batch_size, r_q, r_o):
        return max(1, _floor(batch_size / (1.0 - check_ratio("r_o", r_o))))

    def prune_completions(self, advantages, ratio, generator=None):
        check_group_tensor("advantages", advantages)
        ratio = check_ratio("ratio", ratio)
        flat = advantages.abs().flatten()
        n_keep = max(1, _floor(flat.numel() * (1.0 - ratio)))
        # Largest |A| first; a random order underneath makes the stable sort break ties at random.
        shuffled = torch.randperm(flat.numel(), generator=generator)
        order = shuffled[torch.sort(-flat[shuffled], stable=True).indices]
        keep = torch.zeros(flat.numel(), dtype=torch.bool)
        keep[order[:n_keep]] = True
        keep = keep.view_as(advantages)
        return keep, keep.float()


class CPPOGroup(PruningStrategy):
    """The earlier, weaker CPPO variant ("cppo-group"): the top G - floor(G * P) completions of EACH
    group by |A|, no over-sampling, no reweighting, the full-batch denominator."""

    name = "cppo-group"
    ratios = ("r_o",)
    unbiased = False

    def prune_completions(self, advantages, ratio, generator=None):
        check_group_tensor("advantages", advantages)
        ratio = check_ratio("ratio", ratio)
        g = advantages.shape[1]
        n_keep = max(1, g - _floor(g * ratio))
        # Stable sort on -|A| so ties are broken by position, deterministically.
        order = torch.sort(-advantages.abs(), dim=1, stable=True).indices
        keep = torch.zeros_like(advantages, dtype=torch.bool)
        keep.scatter_(1, order[:, :n_keep], True)
        return keep, keep.float()


class GRESO(PruningStrategy):
    """GRESO as its authors' code runs it (Infini-AI-Lab/GRESO, dynamic_filtering_strategy=
    all_probabilistic with ttis.type=dynamic_sampling):

    - skip an "easy" prompt (its last e rollouts in a row had group mean >= 0.98) with probability
      1 - max(p_easy^e, 0.01), a "hard" one (last h rollouts <= 0.11) with 1 - max(p_hard^h, 0.01);
      never-seen prompts are kept; no reweighting;
    - skipped prompts are replaced (refills), a round rolls out 1.5 B prompts (their
      sampling_batch_size / real_train_batch_size = 384 / 256), zero-variance groups are dropped and
      rounds continue until B informative groups are collected;
    - once per step, over every group rolled out in it: p_easy moves 0.01 down (skip more) when the
      share of all-correct groups is >= target/3, else 0.01 up; p_hard likewise against 2*target/3
      and all-wrong groups; p stays in [0.05, 0.95]; target = 0.25. As in their code (`epoch > 0`),
      the adaptation starts once prompts come back: here, at the first step that rolls out a
      prompt seen in an earlier step.
    p_easy and p_hard start at 1 - r_q (their scripts: 0.5).
    """

    name = "greso"
    ratios = ("r_q",)
    unbiased = False
    refills = True
    filters_zero_variance = True
    one_group_size = "greso's per-step probabilities"
    sampling_factor = 1.5
    skip_floor = 0.01

    def __init__(
        self, target_zero_variance: float = 0.25, p_step: float = 0.01, min_p: float = 0.05, max_p: float = 0.95
    ):
        self.target_easy = target_zero_variance / 3
        self.target_hard = 2 * target_zero_variance / 3
        self.p_step, self.min_p, self.max_p = p_step, min_p, max_p
        self.p_easy: float | None = None
        self.p_hard: float | None = None
        self.adapting = False
        self._seen: set[str] = set()  # prompt ids rolled out so far, only until the first revisit

    def prompts_to_draw(self, batch_size, r_q, r_o):
        return math.ceil(self.sampling_factor * batch_size - _FLOOR_SLACK)

    def _init_p(self, ratio: float) -> None:
        if self.p_easy is None:
            self.p_easy = self.p_hard = 1.0 - ratio

    def skip_probability(self, stats: PromptStats) -> torch.Tensor:
        """float64 [P]: each prompt's chance of being skipped (0 without an easy or hard streak)."""

        def p_skip(p, streak):
            prob = 1.0 - torch.clamp(
                torch.pow(torch.full_like(streak, p, dtype=torch.float64), streak.double()), min=self.skip_floor
            )
            return torch.where(streak > 0, prob, torch.zeros_like(prob))

        # At most one streak is non-zero: the last rollout was either easy, hard or neither.
        return torch.where(
            stats.easy_streak > 0, p_skip(self.p_easy, stats.easy_streak), p_skip(self.p_hard, stats.hard_streak)
        )

    def prune_prompts(self, stats, ratio, generator=None):
        self._init_p(check_ratio("ratio", ratio))
        u = torch.rand(stats.score.shape, generator=generator, dtype=torch.float64)
        keep = u >= self.skip_probability(stats)
        return keep, keep.float()

    def observe(self, prompt_ids, rewards):
        super().observe(prompt_ids, rewards)
        ids = [str(i) for i in prompt_ids]
        if not self.adapting:
            if self._seen.intersection(ids):
                self.adapting, self._seen = True, set()
            else:
                self._seen.update(ids)
        if not self.adapting or self.p_easy is None or not ids:
            return
        r = rewards.double()
        all_correct = float((r.min(dim=1).values >= EASY_MEAN).double().mean())
        all_wrong = float((r.max(dim=1).values <= HARD_MEAN).double().mean())
        self.p_easy = self._move(self.p_easy, all_correct >= self.target_easy)
        self.p_hard = self._move(self.p_hard, all_wrong >= self.target_hard)

    def _move(self, p: float, too_many: bool) -> float:
        # Too many such groups: lower p, so the skip probability 1 - p^streak grows.
        return max(p - self.p_step, self.min_p) if too_many else min(p + self.p_step, self.max_p)

    def state_dict(self) -> dict:
        return {"p_easy": self.p_easy, "p_hard": self.p_hard, "adapting": self.adapting, "seen": sorted(self._seen)}

    def load_state_dict(self, state: dict) -> None:
        try:
            p_easy, p_hard = state["p_easy"], state["p_hard"]
            if (p_easy is None) != (p_hard is None):
                raise ValueError("p_easy and p_hard must both be set or both be null")
            self.p_easy = None if p_easy is None else float(p_easy)
            self.p_hard = None if p_hard is None else float(p_hard)
            if not isinstance(state["adapting"], bool):
                raise TypeError(f"adapting must be a bool, got {state['adapting']!r}")
            self.adapting = state["adapting"]
            self._seen = {str(i) for i in state["seen"]}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"greso strategy state is malformed ({e!r}): expected "
                "{'p_easy': float|null, 'p_hard': float|null, 'adapting': bool, 'seen': [id, ...]}"
            ) from e


class GRESOSimple(PruningStrategy):
    """The earlier, weaker GRESO variant ("greso-simple"): one combined zero-variance streak z,
    skip probability 1 - (1 - r_q)^z, fixed, no refill, no reweighting; completions untouched."""

    name = "greso-simple"
    ratios = ("r_q",)
    unbiased = False

    def prune_prompts(self, stats, ratio, generator=None):
        ratio = check_ratio("ratio", ratio)
        z = stats.zero_var_streak.double()
        p_skip = 1.0 - (1.0 - ratio) ** z
        u = torch.rand(z.shape, generator=generator, dtype=torch.float64)
        keep = u >= p_skip
        return keep, keep.float()


STRATEGIES = {
    "none": NoPruning,
    "dppo": DPPO,
    "reverse": lambda: DPPO(rule="high"),
    "cppo": CPPO,
    "cppo-group": CPPOGroup,
    "greso": GRESO,
    "greso-simple": GRESOSimple,
}


def get_strategy(name: str) -> PruningStrategy:
    if name not in STRATEGIES:
        raise ValueError(f"pruning strategy must be one of {sorted(STRATEGIES)}, got {name!r}")
    return STRATEGIES[name]()
