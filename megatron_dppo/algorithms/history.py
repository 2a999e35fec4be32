"""Per-prompt rollout history: the scores DPPO's prompt pruning (and GRESO) decide by.

Keyed by a stable prompt id (str). Saved as JSON beside the checkpoint: no pickled code.
"""
from __future__ import annotations

import json
import math
import os
import tempfile

import torch

from megatron_dppo.algorithms._checks import check_group_tensor
from megatron_dppo.algorithms.advantages import group_reward_std
from megatron_dppo.algorithms.pruning import PromptStats


class PromptHistory:
    """score(q): std of q's rewards at its last rollout (or an EMA of it, when ema > 0);
    zero_var_streak(q): how many of q's most recent rollouts in a row had zero variance."""

    def __init__(self, ema: float = 0.0):
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"history ema must be in [0, 1) (0 = last value), got {ema!r}")
        self.ema = ema
        self._score: dict[str, float] = {}
        self._streak: dict[str, int] = {}
        self._visits: dict[str, int] = {}

    def __len__(self):
        return len(self._score)

    def stats(self, prompt_ids) -> PromptStats:
        ids = [str(i) for i in prompt_ids]
        return PromptStats(
            score=torch.tensor([self._score.get(i, math.nan) for i in ids], dtype=torch.float32),
            zero_var_streak=torch.tensor([self._streak.get(i, 0) for i in ids], dtype=torch.long),
        )

    def update(self, prompt_ids, rewards: torch.Tensor) -> None:
        """Record one rollout of each prompt: rewards [len(prompt_ids), G]."""
        check_group_tensor("rewards", rewards)
        ids = [str(i) for i in prompt_ids]
        if len(ids) != rewards.shape[0]:
            raise ValueError(f"prompt_ids has {len(ids)} entries but rewards has {rewards.shape[0]} rows")
        stds = group_reward_std(rewards).tolist()
        for pid, std in zip(ids, stds):
            old = self._score.get(pid)
            self._score[pid] = std if old is None or self.ema == 0 else self.ema * old + (1 - self.ema) * std
            self._streak[pid] = self._streak.get(pid, 0) + 1 if std == 0 else 0
            self._visits[pid] = self._visits.get(pid, 0) + 1

    def state_dict(self) -> dict:
        return {"ema": self.ema,
                "prompts": {pid: [self._score[pid], self._streak[pid], self._visits[pid]] for pid in self._score}}

    def load_state_dict(self, state: dict) -> None:
        try:
            self.ema = float(state["ema"])
            prompts = state["prompts"]
            self._score = {str(k): float(v[0]) for k, v in prompts.items()}
            self._streak = {str(k): int(v[1]) for k, v in prompts.items()}
            self._visits = {str(k): int(v[2]) for k, v in prompts.items()}
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"prompt history state is malformed ({e!r}): expected "
                             "{'ema': float, 'prompts': {id: [score, streak, visits]}}") from e

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
    def load(cls, path: str) -> "PromptHistory":
        with open(path) as f:
            try:
                state = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not a prompt-history JSON file ({e})") from e
        history = cls()
        history.load_state_dict(state)
        return history
