"""User reward functions for the trainer's tests ("trainer_rewards:..." on PYTHONPATH=tests): ones that fail,
and the dict and batched forms."""


def raise_on_leading_one(completion: str, answer: str, record=None) -> float:
    """Exact match, except that completions starting with '1' raise."""
    if completion.startswith("1"):
        raise ZeroDivisionError("a bug in the user's reward function")
    return float(completion.strip() == answer.strip())


def always_nan(completion: str, answer: str, record=None) -> float:
    return float("nan")


def raise_on_one_hang_on_nine(completion: str, answer: str, record=None) -> float:
    """Exact match, except that completions starting with '1' raise and with '9' hang."""
    if completion.startswith("9"):
        import time

        time.sleep(10_000)
    return raise_on_leading_one(completion, answer, record)


def exact_with_extras(completion: str, answer: str, record=None) -> dict:
    """Exact match as a dict reward: "score" and two extras (logged as reward/<source>/<name>)."""
    exact = float(completion.strip() == answer.strip())
    return {"score": exact, "exact": exact, "length": float(len(completion))}


def batched_exact(completions: list, answers: list, records: list) -> list:
    """The batched form (reward.batched=true): one call for all of a step's completions of its
    kind; the extra "batch" is how many completions the call got."""
    return [
        {"score": float(c.strip() == a.strip()), "batch": float(len(completions))} for c, a in zip(completions, answers)
    ]
