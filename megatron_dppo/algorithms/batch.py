"""What a step trains: the batch-planning rules of every method, as pure functions over Groups.

The trainer (I/O: vLLM, rewards, packing, the Megatron policy) and `verify-unbiased` (a synthetic
rollout) both call these, so the Monte Carlo check tests the trainer's own rules:

    method  = Method.from_config(cfg, strategy)                    # once per run
    rollout = collect(method, strategy, next_batch=..., stats_of=..., rollout=..., generator=gen)
              # rounds: draw_round -> prune prompts -> rollout(...) -> select_groups [-> refill]
    weigh_completions(method, strategy, rollout.trained, gen)      # advantages, prune completions
    plans   = plan_minibatches(method, rollout.trained, rollout.drawn)  # groups + denominator each

`Group.prompt_weight` is w_q as drawn (never changed); `Group.train_weight` is the weight the
group trains with (w_q, or its refill share); `Group.completion_weights` are w_o (0 = not trained).
docs/algorithm.md gives the rules and why each denominator keeps the full-batch objective.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_dppo.algorithms import losses
from megatron_dppo.algorithms.advantages import group_advantages
from megatron_dppo.algorithms.methods import registry
from megatron_dppo.algorithms.methods.base import AuxLoss, Curriculum, Reweighting, Selection, Weighed
from megatron_dppo.algorithms.packing import Sample
from megatron_dppo.algorithms.pruning import PromptStats, PruningStrategy, drop_zero_variance_groups
from megatron_dppo.algorithms.records import Group, size_runs, stack_rewards
from megatron_dppo.algorithms.refill import take_until_full

# A strategy that replaces what it skips (GRESO) draws until enough prompts survive; when almost
# every prompt is skipped that would never end. Past this many times the round's target, the
# round stops with what survived (and refill, if any, continues in the next round).
MAX_DRAW_FACTOR = 16
# Refill is complete when the trained weight reaches B up to float rounding of the remainders.
_FULL_TOL = 1e-9

DENOMINATORS = ("full", "refill", "kept")


@dataclass(frozen=True)
class Method:
    """Everything a step's planning decides by, resolved once from the config and the strategy.

    refill: drop uninformative groups and draw again until the trained weight reaches B
        (DAPO dynamic sampling, or a strategy that replaces what it skips: GRESO).
    redraw_skipped: within a round, draw until prompts_per_round prompts survive prompt pruning
        (a strategy that replaces what it skips: GRESO).
    drop_uninformative: zero-variance groups are not trained at all (DAPO's filter, GRESO's).
    drop_zero_variance: zero-variance groups get weight 0 (exact only without a KL term).
    overlong_filter: truncated completions get weight 0 and no loss tokens (DAPO's overlong
        filtering; docs/algorithm.md says what it does to each aggregation's denominator).
    denominator: "full" (the unpruned batch's normaliser, docs/dppo.md section 4), "refill" (the
        trained groups' weights stand for the unpruned DAPO batch), "kept" (what was trained,
        CPPO as published) or the selection's own (BPPO's: its selected prefixes, docs/methods.md 1.1.7).
    selection, reweighting, curriculum, aux: the options the config chose for the method slots
        (algorithms/methods/registry.py), whose hooks the step calls with this Method; the hooks
        read it as methods/base.StepSettings, so the methods never import this module.
    """

    strategy: str
    advantage: str
    loss_agg: str
    batch_size: int  # B
    group_size: int  # G
    max_new_tokens: int  # Lmax of the Dr.GRPO normaliser
    r_q: float
    r_o: float
    minibatches: int
    epochs: int
    prompts_per_round: int
    rounds: int
    refill: bool
    redraw_skipped: bool
    drop_uninformative: bool
    drop_zero_variance: bool
    overlong_filter: bool
    denominator: str
    needs_reference: bool
    selection: Selection = field(default_factory=Selection)
    reweighting: Reweighting = field(default_factory=Reweighting)
    curriculum: Curriculum = field(default_factory=Curriculum)
    aux: AuxLoss = field(default_factory=AuxLoss)

    @classmethod
    def from_config(cls, cfg, strategy: PruningStrategy) -> Method:
        a, p, t = cfg.algorithm, cfg.pruning, cfg.trainer
        refill = a.dynamic_sampling or strategy.refills
        recipe = registry.recipe(a)
        if recipe.selection.denominator:
            denominator = recipe.selection.denominator
        elif strategy.denominator == "kept":
            denominator = "kept"
        else:
            denominator = "refill" if refill else "full"
        return cls(
            strategy=strategy.name,
            advantage=a.advantage,
            loss_agg=a.loss_agg,
            batch_size=t.prompts_per_step,
            group_size=cfg.rollout.group_size,
            max_new_tokens=cfg.rollout.max_new_tokens,
            r_q=p.r_q,
            r_o=p.r_o,
            minibatches=t.minibatches_per_step,
            epochs=t.epochs_per_step,
            prompts_per_round=strategy.prompts_to_draw(t.prompts_per_step, p.r_q, p.r_o),
            rounds=1 + (a.max_resample_rounds if refill else 0),
            refill=refill,
            redraw_skipped=strategy.refills,
            drop_uninformative=a.dynamic_sampling or strategy.filters_zero_variance,
            drop_zero_variance=bool(p.drop_zero_variance),
            overlong_filter=a.overlong_filter,
            denominator=denominator,
            needs_reference=a.kl_coef > 0,
            **vars(recipe),
        )

    def replace(self, **changes) -> Method:
        return dataclasses.replace(self, **changes)


def minibatch_of(position: float, total: float, minibatches: int) -> int:
    """The mini-batch of a group at `position` of `total` (a slot among the drawn prompts, or the
    weight filled before it under refill): equal shares of the draw, in draw order."""
    return min(int(position * minibatches / total), minibatches - 1)


# ---- prompts: one round's draw and the strategy's decision before rollout ----------------------


@dataclass
class Round:
    """One round's drawn prompts and the strategy's decision on each (before any rollout)."""

    records: list
    keep: torch.Tensor  # bool [len(records)]
    weight: torch.Tensor  # float [len(records)]: w_q, 0 where skipped

    def kept(self) -> list[tuple]:
        """(record, slot, w_q) of the prompts to roll out, in slot order."""
        return [(self.records[i], i, float(self.weight[i])) for i in self.keep.nonzero().flatten().tolist()]


def draw_round(
    method: Method,
    strategy: PruningStrategy,
    next_batch: Callable[[int], list],
    stats_of: Callable[[list], PromptStats],
    generator: torch.Generator,
) -> Round:
    """Draw a round's prompts and prune them. With method.redraw_skipped (GRESO) it keeps drawing
    until prompts_per_round prompts survive, as its authors' code does; the survivors past that
    number are left out (never rolled out, weight 0)."""
    want = method.prompts_per_round
    records, keeps, weights = [], [], []
    while True:
        prompts = next_batch(method.batch_size if method.redraw_skipped else want)
        keep, weight = strategy.prune_prompts(stats_of([r.id for r in prompts]), method.r_q, generator)
        records += prompts
        keeps.append(keep)
        weights.append(weight)
        survived = int(sum(k.sum() for k in keeps))
        if not method.redraw_skipped or survived >= want or len(records) >= MAX_DRAW_FACTOR * want:
            break
    keep, weight = torch.cat(keeps), torch.cat(weights)
    beyond = keep.cumsum(0) > want
    return Round(records, keep & ~beyond, torch.where(beyond, torch.zeros_like(weight), weight))


# ---- groups: which rolled-out groups train, with which weight, in which mini-batch --------------


def select_groups(method: Method, groups: list[Group], num_drawn: int, filled: float) -> tuple[list[Group], float]:
    """A round's rolled-out groups (slot order) -> (the ones the step trains, the weight filled).

    Without refill every group trains with its w_q, in the mini-batch of its slot. With refill
    each group counts with its weight (a kept candidate stands for the prompts pruning skipped, so
    those are not also replaced by new draws: algorithms/refill.py), the group that fills B
    trains with the remainder, and the mini-batch follows the weight filled before it."""
    candidates = [g for g in groups if g.informative()] if method.drop_uninformative else list(groups)
    n = method.minibatches
    if not method.refill:
        for g in candidates:
            g.train_weight, g.minibatch = g.prompt_weight, minibatch_of(g.slot, num_drawn, n)
        return candidates, filled
    trained = []
    for g, w in zip(candidates, take_until_full([g.prompt_weight for g in candidates], method.batch_size, filled)):
        if w > 0:
            g.train_weight, g.minibatch = w, minibatch_of(filled, method.batch_size, n)
            trained.append(g)
            filled += w
    return trained, filled


def batch_is_full(method: Method, filled: float) -> bool:
    return filled >= method.batch_size - _FULL_TOL


@dataclass
class Collected:
    """A step's groups: those it trains, every one rolled out (the history and metrics see all of
    them), and the number of prompts drawn."""

    trained: list[Group]
    rolled: list[Group]
    drawn: int


def collect(
    method: Method,
    strategy: PruningStrategy,
    *,
    next_batch: Callable[[int], list],
    stats_of: Callable[[list], PromptStats],
    rollout: Callable[[int, list[tuple]], list[Group]],
    generator: torch.Generator,
    select=None,
    first_round: Round | None = None,
) -> Collected:
    """The step's rounds: draw and prune prompts BEFORE generation, `rollout(round, items)` the
    kept ones (items: (record, slot, w_q); it returns their Groups in slot order, and records them
    in the history), select what trains; with refill, draw again until the weight reaches B or
    method.rounds are spent. `select` replaces select_groups (verify-unbiased's negative control).
    first_round: round 0, drawn earlier with this generator (dedicated rollout ranks draw the
    next step's prompts while this step trains, then roll them out)."""
    select = select or select_groups
    trained, rolled, drawn, filled = [], [], 0, 0.0
    for rnd in range(method.rounds):
        if rnd == 0 and first_round is not None:
            drawn_round = first_round
        else:
            drawn_round = draw_round(method, strategy, next_batch, stats_of, generator)
        drawn += len(drawn_round.records)
        groups = rollout(rnd, drawn_round.kept())
        rolled += groups
        chosen, filled = select(method, groups, len(drawn_round.records), filled)
        trained += chosen
        if not method.refill or batch_is_full(method, filled):
            break
    return Collected(trained, rolled, drawn)


# ---- completions: advantages on the full group, then completion pruning -------------------------


def weigh_completions(
    method: Method, strategy: PruningStrategy, groups: list[Group], generator: torch.Generator
) -> dict:
    """Set each group's advantages (on the FULL group) and completion weights w_o (0 = not
    trained). Returns the step's completion-pruning metrics. Groups of one size are weighed as
    one [P, G] batch; BPPO's waves (a size per prompt) weigh each run of equal sizes the same way."""
    if not groups:
        return {"prune/completions_kept_frac": 0.0, "prune/completions_pruned_frac": 0.0}
    runs = size_runs(groups)
    parts = [_weigh_groups(method, strategy, run, generator) for run in runs]
    adv, keep, w_o = (torch.cat([getattr(p, f).flatten() for p in parts]) for f in ("advantages", "keep", "weights"))
    extra = method.selection.metrics(parts)
    if parts[0].response_weights is not None:
        extra.update(method.reweighting.metrics(torch.cat([p.response_weights.flatten() for p in parts])))
    trained = torch.cat([sequence_weights(run).flatten() for run in runs])
    trained = trained[trained > 0]
    return {
        "prune/completions_kept_frac": float((w_o > 0).float().mean()),
        "prune/completions_pruned_frac": float((~keep).float().mean()),
        "adv/abs_mean": float(adv.abs().mean()),
        "adv/max": float(adv.max()),
        "adv/min": float(adv.min()),
        "weight/mean": float(trained.mean()) if trained.numel() else 0.0,  # over trained completions
        "weight/max": float(trained.max()) if trained.numel() else 0.0,
        **extra,
    }


def _weigh_groups(
    method: Method, strategy: PruningStrategy, groups: list[Group], generator: torch.Generator
) -> Weighed:
    """weigh_completions for groups of one size ([P, G] each)."""
    adv = group_advantages(stack_rewards(groups), method.advantage)
    # completion pruning, or a selection that replaces it (BPPO's pair: r_o = 0 with it)
    keep, w_o, prefix = method.selection.select(method, strategy, groups, adv, generator)
    w_o = w_o * keep
    u = method.reweighting.response_weights(method, groups)  # fixed before any update (ReCo's)
    if u is not None:
        w_o = w_o * u
    if method.drop_zero_variance:  # all-zero-advantage groups: exactly zero loss and gradient
        w_o = w_o * drop_zero_variance_groups(adv)[:, None]
    if method.overlong_filter:  # after the advantages: truncated completions still count in their group's
        truncated = torch.tensor([g.truncated for g in groups], dtype=torch.bool).reshape(w_o.shape)
        w_o = w_o * ~truncated
        for g in groups:  # and their tokens leave the token-mean normaliser of the full batch too
            g.trained_tokens = [0 if t else n for t, n in zip(g.truncated, g.loss_lengths())]
    for g, a, w in zip(groups, adv.tolist(), w_o.tolist()):
        g.advantages, g.completion_weights = a, w
    return Weighed(adv, keep, w_o, u, prefix)


# ---- mini-batches: what each optimizer step trains and its full-batch denominator ----------------


@dataclass
class MiniBatch:
    """One optimizer step's share of the rollout batch. The plan fills groups, samples and the
    denominator; packing fills this rank's micro-batches and the packs' density."""

    index: int
    groups: list[Group]
    samples: list[Sample]  # the trained completions, prompt + completion each
    denominator: float
    microbatches: list = field(default_factory=list)  # this rank's packing.ThdBatch micro-batches
    density: float = 0.0
    num_prompts: float = 0.0  # B of this mini-batch's full batch (the aux loss's 1/B)
    aux_pairs: list = field(default_factory=list)  # the aux loss's items (SSOPD: distill.AuxPair of its mixed groups)
    aux_microbatches: list = field(default_factory=list)  # ... packed by the aux loss (AuxLoss.pack)

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.tokens) - s.prompt_len for s in self.samples)


def prompts_in_minibatch(k: int, num_drawn: int, minibatches: int) -> int:
    """How many of the drawn slots fall into mini-batch k (the full batch's share of B)."""
    return sum(1 for slot in range(num_drawn) if minibatch_of(slot, num_drawn, minibatches) == k)


def denominator(method: Method, groups: list[Group], num_prompts: float) -> float:
    """The aggregation's normaliser of the batch the UNPRUNED method trains (docs/algorithm.md).

    groups: every group of the mini-batch the unpruned method would train (zero-variance ones
    too, unless the method filters them); all their completions were generated.
    full:   the mini-batch's share of the drawn prompts (num_prompts, exact); token-mean
            estimated over its groups with their prompt weights (Horvitz-Thompson).
    refill: the trained groups' weights (their sum is B when refill succeeds).
    kept:   the kept completions (CPPO normalises over what it kept).
    A selection with its own denominator (BPPO's) gives it instead."""
    G, agg, lmax = method.group_size, method.loss_agg, method.max_new_tokens
    own = method.selection.own_denominator(method, groups)
    if own is not None:
        return own
    lengths = torch.tensor([g.loss_lengths() for g in groups], dtype=torch.float64).reshape(-1, G)
    weights = torch.tensor([g.train_weight for g in groups], dtype=torch.float64)
    if method.denominator == "kept":
        seq_weight = torch.tensor([g.completion_weights for g in groups], dtype=torch.float64) * weights[:, None]
        return losses.kept_denominator(agg, seq_weight, lengths, lmax)
    if method.denominator == "refill":
        return losses.refill_denominator(agg, weights, lengths, G, lmax)
    return losses.full_batch_denominator(
        agg,
        num_prompts=num_prompts,
        group_size=G,
        completion_lengths=lengths,
        prompt_weight=weights,
        max_response_length=lmax,
    )


def plan_minibatches(method: Method, trained: list[Group], num_drawn: int) -> list[MiniBatch]:
    """Each mini-batch's groups, trained samples and denominator. A mini-batch whose completions
    were all pruned (or uninformative) trains nothing: no gradient, no optimizer step."""
    plans = []
    for k in range(method.minibatches):
        groups = [g for g in trained if g.minibatch == k]
        first = [0, *itertools.accumulate(g.group_size for g in groups)]  # n * G for groups of one size
        samples = [s for n, g in enumerate(groups) for s in g.samples(first_seq_id=first[n])]
        if not samples:
            continue
        count = prompts_in_minibatch(k, num_drawn, method.minibatches)
        mb = MiniBatch(k, groups, samples, denominator(method, groups, count))
        mb.num_prompts = sum(g.train_weight for g in groups) if method.refill else count
        mb.aux_pairs = method.aux.pairs(method, groups)
        plans.append(mb)
    return plans


def needs_old_logprobs(method: Method, minibatches: list[MiniBatch]) -> bool:
    """pi_old must be computed before the first update when the rollout batch feeds more than one
    optimizer step (at a single update pi_old = pi_theta exactly: megatron/loss.py), or when the
    reweighting's token scale (ReCo's) needs its pass."""
    return len(minibatches) * method.epochs > 1 or method.reweighting.needs_token_scale


def sequence_weights(groups: list[Group]) -> torch.Tensor:
    """[len(groups), G] float64: the weight each completion trains with (w_q-or-refill x w_o)."""
    return torch.tensor(
        [[g.train_weight * w for w in g.completion_weights] for g in groups], dtype=torch.float64
    ).reshape(len(groups), -1)
