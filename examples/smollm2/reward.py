"""The SmolLM2 example's reward (reward.kind: examples/smollm2/reward.py:final_number_reward).

The final answer is read the way math graders read a free-form completion: the last \\boxed{...}
if there is one, else the text after the last "####" (GSM8K), else the last number in the text
(lm-evaluation-harness's "flexible-extract" for GSM8K). A 135M instruct model answers "13 + 34 = 47"
far more often than it writes "####", so the third rule is the one that usually applies; what it
rewards is the answer the completion ends on, not any number it mentions on the way.
"""

from __future__ import annotations

import re

from megatron_dppo.rewards.extract import gsm8k_final, last_boxed

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(completion: str) -> str | None:
    """The completion's final answer as a plain number string ("1,234" -> "1234"); None if none."""
    for text in (last_boxed(completion), gsm8k_final(completion), completion):
        if text is None:
            continue
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1].replace(",", "").rstrip(".")
    return None


def final_number_reward(completion: str, answer: str, record=None) -> float:
    """1.0 iff the final number equals the gold answer (compared as numbers: "47.0" == "47")."""
    pred = final_number(completion)
    if pred is None:
        return 0.0
    return 1.0 if float(pred) == float(str(answer).strip()) else 0.0
