"""Megatron-Core's vocabulary padding: one formula for the model, the converters and the planner.

Import-free on purpose: `megatron-dppo plan` uses it without importing torch or Megatron.
"""

VOCAB_DIVISIBLE_BY = 128  # Megatron's make_vocab_size_divisible_by, as the model is built with


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Each TP rank holds an equal slice of the output layer whose size is a multiple of
    `divisible_by`. Rows >= vocab are padding (mask them in log-probs: megatron/logprobs.py)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple
