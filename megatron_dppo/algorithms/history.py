"""Per-prompt rollout history: the scores DPPO's prompt pruning (and GRESO) decide by.

Keyed by a stable prompt id (str). The trainer records EVERY rolled-out prompt, before any
filter (zero-variance groups included: they are the most prunable). Saved as JSON beside the
checkpoint: no pickled code.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import torch

from megatron_dppo.algorithms._checks import check_group_tensor
from megatron_dppo.algorithms.advantages import group_reward_std
from megatron_dppo.algorithms.pruning import EASY_MEAN, HARD_MEAN, PromptStats

# JSON layout version 2: {"version": 2, "ema": e, "prompts": {id: [score, zero_var_streak, visits,
# easy_streak, hard_streak]}}. Version 1 (no "version" key) had [score, zero_var_streak, visits].
_FIELDS = ("score", "zero_var_streak", "visits", "easy_streak", "hard_streak")
_VERSION = 2


class PromptHistory:
    """score(q): std of q's rewards at its last rollout (or an EMA of it, when ema > 0);
    zero_var_streak(q): how many of q's most recent rollouts in a row had zero variance;
    easy_streak(q) / hard_streak(q): how many in a row had group mean reward >= EASY_MEAN
    (all correct) / <= HARD_MEAN (all wrong), GRESO's two streaks."""

    def __init__(self, ema: float = 0.0):
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"history ema must be in [0, 1) (0 = last value), got {ema!r}")
        self.ema = ema
        self._rows: dict[str, list] = {}  # id -> [score, zero_var_streak, visits, easy_streak, hard_streak]

    def __len__(self):
        return len(self._rows)

    def stats(self, prompt_ids) -> PromptStats:
        rows = [self._rows.get(str(i)) for i in prompt_ids]

        def column(k, missing, dtype):
            return torch.tensor([missing if r is None else r[k] for r in rows], dtype=dtype)

        return PromptStats(
            score=column(0, math.nan, torch.float32),
            zero_var_streak=column(1, 0, torch.long),
            easy_streak=column(3, 0, torch.long),
            hard_streak=column(4, 0, torch.long),
        )

    def update(self, prompt_ids, rewards: torch.Tensor) -> None:
        """Record one rollout of each prompt: rewards [len(prompt_ids), G]."""
        check_group_tensor("rewards", rewards)
        ids = [str(i) for i in prompt_ids]
        if len(ids) != rewards.shape[0]:
            raise ValueError(f"prompt_ids has {len(ids)} entries but rewards has {rewards.shape[0]} rows")
        stds = group_reward_std(rewards).tolist()
        means = rewards.double().mean(dim=1).tolist()
        for pid, std, mean in zip(ids, stds, means):
            old = self._rows.get(pid, [None, 0, 0, 0, 0])
            score = std if old[0] is None or self.ema == 0 else self.ema * old[0] + (1 - self.ema) * std
            self._rows[pid] = [
                score,
                old[1] + 1 if std == 0 else 0,
                old[2] + 1,
                old[3] + 1 if mean >= EASY_MEAN else 0,
                old[4] + 1 if mean <= HARD_MEAN else 0,
            ]

    def state_dict(self) -> dict:
        return {"version": _VERSION, "ema": self.ema, "prompts": {pid: list(r) for pid, r in self._rows.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Loads version 2 and the older version 1 (which had no easy/hard streaks: they start at
        0, so GRESO treats those prompts as neither easy nor hard until their next rollout)."""
        expected = (
            "{'version': 2, 'ema': float, 'prompts': {id: [score, zero_var_streak, visits, "
            "easy_streak, hard_streak]}} (or version 1: {'ema': float, 'prompts': {id: [score, "
            "zero_var_streak, visits]}})"
        )
        if not isinstance(state, dict):
            raise ValueError(f"prompt history state must be a JSON object {expected}, got {type(state).__name__}")
        version = state.get("version", 1)
        if version not in (1, _VERSION):
            raise ValueError(f"prompt history state has version {version!r}: expected 1 or {_VERSION}")
        width = 3 if version == 1 else len(_FIELDS)
        try:
            ema = float(state["ema"])
            prompts = state["prompts"]
            if not isinstance(prompts, dict):
                raise TypeError(f"'prompts' must be an object, got {type(prompts).__name__}")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"prompt history state is malformed ({e!r}): expected {expected}") from e
        rows = {}
        for pid, v in prompts.items():
            if not isinstance(v, list) or len(v) != width:
                raise ValueError(
                    f"prompt history state is malformed: prompt {pid!r} has {v!r}, expected a list "
                    f"of {width} numbers [{', '.join(_FIELDS[:width])}] (version {version})"
                )
            try:
                row = [float(v[0])] + [int(x) for x in v[1:]] + [0] * (len(_FIELDS) - width)
            except (TypeError, ValueError) as e:
                raise ValueError(f"prompt history state is malformed: prompt {pid!r} has {v!r} ({e})") from e
            rows[str(pid)] = row
        self.ema, self._rows = ema, rows

    def save(self, path: str) -> None:
        """Atomic: write a temporary file beside `path`, then rename over it."""
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".history-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> PromptHistory:
        with open(path) as f:
            try:
                state = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not a prompt-history JSON file ({e})") from e
        history = cls()
        try:
            history.load_state_dict(state)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
        return history
