"""User reward functions that fail, for the trainer's tests ("trainer_rewards:..." on PYTHONPATH=tests)."""


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
