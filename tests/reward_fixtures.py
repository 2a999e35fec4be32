"""Reward functions for trainer tests, named by import path ("reward_fixtures:...")."""

import time


def hang_on_leading_one(completion: str, answer: str, record=None) -> float:
    """Exact match, except that completions starting with '1' hang forever."""
    if completion.startswith("1"):
        time.sleep(10_000)
    return float(completion.strip() == answer.strip())


def slow_exact(completion: str, answer: str, record=None) -> float:
    """Exact match that takes 0.3 s: long enough to signal a worker in the middle of a check."""
    time.sleep(0.3)
    return float(completion.strip() == answer.strip())
