"""The hooks a step calls for each method slot, and what the plain GRPO step does at each.

The config composes a step from four slots, each a key of `algorithm` naming one option
(algorithms/methods/registry.py maps the names to these classes):
    selection    which completions of a group train        all (GRPO) | bppo
    reweighting  the completions' and tokens' weights       none | reco
    curriculum   what the prompts the engine continues are  none | adaprefix
    aux          an auxiliary loss beside the policy loss   none | ssopd
The classes below are the plain step's options ("all", "none"): every hook does what GRPO does
(or nothing). A method subclasses its slot's class and overrides the hooks it changes; the step
(algorithms/batch.py, the trainer, the loss, config/checks.py) calls the hooks of the options the
config chose, built once (`registry.recipe`), and never compares a method's name.

Hooks take the step's settings as `method` (algorithms/batch.Method, read through the
StepSettings protocol below) and plain records (Groups, tensors); nothing here imports the step
(algorithms/batch.py imports this package: pyproject.toml's import-linter contract keeps it one
way), Megatron or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from megatron_dppo.algorithms.pruning import PruningStrategy
    from megatron_dppo.algorithms.records import Group


@runtime_checkable
class StepSettings(Protocol):
    """What the hooks read of the step's settings, algorithms/batch.Method (which has these and
    more). A hook that needs another of Method's fields names it here too (tests/unit/test_methods
    checks that every `method.<field>` read under algorithms/methods/ is listed)."""

    @property
    def r_o(self) -> float: ...  # the completion-pruning ratio

    @property
    def group_size(self) -> int: ...  # G

    @property
    def loss_agg(self) -> str: ...

    @property
    def max_new_tokens(self) -> int: ...  # Lmax of the Dr.GRPO normaliser


class Option:
    """One value of a slot key. `section` names the algorithm.<section> config it reads (its
    keys are inert under another option of the slot); `cfg` is that section."""

    slot = ""  # the algorithm.* key
    name = ""  # the key's value that chooses this option
    section: str | None = None

    def __init__(self, algorithm=None):
        self.cfg = getattr(algorithm, self.section) if self.section and algorithm is not None else None

    @property
    def enabled(self) -> bool:
        """False for the plain GRPO step's option of the slot (all / none)."""
        return type(self) not in DEFAULTS

    @classmethod
    def check_section(cls, cfg, chosen: bool) -> None:
        """Config errors of this option's own section, checked whether it is chosen or not."""
        if cls.section:
            getattr(cfg.algorithm, cls.section).validate(f"algorithm.{cls.section}")

    def check(self, cfg, strategy: PruningStrategy, recipe: Recipe) -> None:
        """Config errors of the chosen option with the rest of the config (one line naming the keys)."""

    def inert_keys(self, cfg) -> dict[str, str]:
        """Keys the chosen option makes inert -> why (config/checks.inert_keys)."""
        return {}


@dataclass
class Weighed:
    """weigh_completions' result for a run of groups of one size, each [P, G]: advantages on the
    full group, which completions the selection kept, their weights w_o (0 = not trained), the
    reweighting's response weights (None without one) and the selection's prefix lengths (None
    when it trains whole completions)."""

    advantages: torch.Tensor
    keep: torch.Tensor
    weights: torch.Tensor
    response_weights: torch.Tensor | None = None
    prefix: torch.Tensor | None = None


class Selection(Option):
    """algorithm.selection=all: every completion trains, thinned by the pruning strategy's
    completion pruning (r_o), over the step's usual denominator."""

    slot, name = "selection", "all"
    denominator = None  # the name Method.denominator shows when the selection normalises itself

    def select(self, method: StepSettings, strategy: PruningStrategy, groups: list[Group], advantages, generator):
        """-> (keep [P, G] bool, w_o [P, G] float, trained prefix lengths [P, G] or None)."""
        keep, w_o = strategy.prune_completions(advantages, method.r_o, generator)
        return keep, w_o, None

    def own_denominator(self, method: StepSettings, groups: list[Group]) -> float | None:
        """The mini-batch's denominator when the selection has its own; None: the step's (full, refill, kept)."""
        return None

    def metrics(self, parts: list[Weighed]) -> dict:
        return {}

    def completions_wanted(self, group: Group | None, group_size: int) -> int:
        """How many more completions a prompt gets (group: what it has so far, None before its
        first): its whole group in one engine call."""
        return group_size if group is None else 0


class Reweighting(Option):
    """algorithm.reweighting=none: completions train with w_q w_o, tokens with the clipped surrogate."""

    slot, name = "reweighting", "none"
    needs_token_scale = False  # a pi_old pass over every trained token before the first update
    needs_impurity = False  # that pass also returns each position's Gini impurity

    def response_weights(self, method: StepSettings, groups: list[Group]) -> torch.Tensor | None:
        """u [P, G] multiplying w_o, fixed before any update; None: no response weights."""
        return None

    def metrics(self, response_weights: torch.Tensor) -> dict:
        return {}

    def token_loss(self, algorithm, logp, old_logp, advantages, batch, picked):
        """The loss tokens' per-token loss and stats, in place of the clipped surrogate; None: that surrogate."""
        return None

    def check_engine(self, logprobs_mode: str, rollout) -> None:
        """Refuse an engine whose sampling log-probs this option cannot use."""

    def attach_token_scale(self, microbatches: list, all_reduce_sum) -> float | None:
        """Scale each micro-batch's token_scale (after the pi_old pass); returns the metric's value."""
        return None


class Curriculum(Option):
    """algorithm.curriculum=none: the engine continues the rendered prompt."""

    slot, name = "curriculum", "none"

    def build(self, cfg, *, records, tokenizer, renderer):
        """The run's curriculum state (with assisted(), observe(), state_dict()); None: no curriculum."""
        return None

    def input_warnings(self, cfg, tokenizer) -> list[str]:
        """Start-up warnings that need the tokenizer (train/preflight.input_warnings)."""
        return []

    def inert_keys(self, cfg) -> dict[str, str]:
        return {"data.solution_key": f"algorithm.curriculum={cfg.algorithm.curriculum} shows no reference solution"}


class AuxLoss(Option):
    """algorithm.aux=none: the policy loss alone."""

    slot, name = "aux", "none"

    def pairs(self, method: StepSettings, groups: list[Group]) -> list:
        """The mini-batch's auxiliary items, chosen from its full groups; [] for none."""
        return []

    def pack(self, minibatches: list, *, tokens, layout, max_context: int) -> dict:
        """Build each mini-batch's aux_microbatches from its pairs (layout: packing.PackLayout);
        returns the step's metrics."""
        return {}

    def tokens(self, tokenizer, renderer):
        """The token ids pack() needs (from the tokenizer and the prompt renderer), or None."""
        return None


DEFAULTS = (Selection, Reweighting, Curriculum, AuxLoss)


@dataclass(frozen=True)
class Recipe:
    """The options a config chose, one per slot, built once (registry.recipe)."""

    selection: Selection
    reweighting: Reweighting
    curriculum: Curriculum
    aux: AuxLoss

    def options(self) -> tuple[Option, ...]:
        return (self.selection, self.reweighting, self.curriculum, self.aux)
