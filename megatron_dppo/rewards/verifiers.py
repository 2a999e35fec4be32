"""The built-in reward kinds: "exact" (the synthetic tasks) and "math" (math-verify)."""

from __future__ import annotations

from megatron_dppo.rewards.extract import answer_after_thinking, gsm8k_final, last_boxed

BUILTIN_KINDS = {
    "exact": "megatron_dppo.rewards.verifiers:exact_reward",
    "math": "megatron_dppo.rewards.verifiers:math_reward",
}


def exact_match(completion: str, answer: str) -> float:
    """The synthetic tasks' verifier: 1.0 iff the completion is exactly the answer.

    Only surrounding whitespace is forgiven; "0579", "579 " + junk, or "579=579" are wrong, so the
    reward cannot be gamed by emitting several candidates.
    """
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def exact_reward(completion: str, answer: str, record=None) -> float:
    return exact_match(completion, answer)


def math_reward(completion: str, answer: str, record=None) -> float:
    """1.0 iff math-verify finds the completion's final answer equivalent to the gold answer. With a
    thinking block only the text after it is read; a block never closed has no answer: 0.0."""
    from math_verify import parse, verify  # lazily: only math workers pay for sympy

    gold_text = str(answer)
    gold = parse(gold_text if "\\boxed" in gold_text else "\\boxed{" + gold_text + "}")
    if not gold:
        raise ValueError(f"gold answer {gold_text[:80]!r} could not be parsed")
    completion = answer_after_thinking(completion)
    if completion is None:
        return 0.0
    # Take the final answer only: math-verify reads several \boxed{} as a set, so "\boxed{41} ...
    # wait, \boxed{42}" would never equal 42, and a list of guesses must not be rewarded.
    final = last_boxed(completion)
    if final is None:
        final = gsm8k_final(completion)
    pred = parse("\\boxed{" + final + "}") if final is not None else parse(completion)
    return 1.0 if pred and verify(gold, pred) else 0.0
