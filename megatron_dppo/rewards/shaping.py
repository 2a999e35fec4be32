"""Reward shaping applied by the trainer on top of a verifier's score."""

from __future__ import annotations


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) scaled by `penalty`:

        0                                   length <= max_new_tokens - buffer
        ((max_new_tokens - buffer) - length) / buffer * penalty     up to max_new_tokens
        -penalty                            length > max_new_tokens

    i.e. zero up to the last `buffer` tokens of the generation budget, then linear down to
    -penalty at max_new_tokens (the paper's L_max = max_new_tokens, L_cache = buffer).
    buffer 0 turns it off. It is added to the reward of a completion of `length` tokens."""
    if buffer == 0:
        return 0.0
    if not 0 < buffer < max_new_tokens:
        raise ValueError(f"overlong buffer must be in [0, max_new_tokens={max_new_tokens}), got {buffer}")
    expected = max_new_tokens - buffer
    if length <= expected:
        return 0.0
    return max((expected - length) / buffer, -1.0) * penalty
