import math
import os
import time

import pytest

from megatron_dppo.rewards import RewardFailureError, RewardScorer, gsm8k_final, last_boxed, math_reward

# Reward functions the scorer's workers import by path: this module is importable in them
# because the worker processes inherit the parent's sys.path.
HERE = __name__


def length_reward(completion, answer, record):
    return float(len(completion)) + (record or {}).get("bonus", 0.0)


def misbehaving_reward(completion, answer, record):
    if completion == "hang":
        time.sleep(1e9)
    if completion == "crash":
        os._exit(7)  # takes the worker process down, like a segfault in a native parser would
    if completion == "raise":
        raise RuntimeError("verifier bug")
    if completion == "nan":
        return math.nan
    if completion == "inf":
        return -math.inf
    if completion == "string":
        return "1"  # looks like a reward, is a bug
    if completion == "none":
        return None
    return 1.0 if completion == answer else 0.0


def always_hangs(completion, answer, record):
    time.sleep(1e9)


@pytest.fixture(scope="module")
def math_scorer():
    with RewardScorer("math", timeout_s=10.0, num_workers=2) as s:
        yield s


def test_last_boxed_and_gsm8k_extraction():
    assert last_boxed(r"so \boxed{41}, no wait: \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\fbox{7} and later \boxed 5$") == "5"
    assert last_boxed(r"\boxed{unbalanced") is None
    assert last_boxed("no box") is None
    assert gsm8k_final("48/2 = 24\n#### 72\n") == "72"
    assert gsm8k_final("no marker") is None


def test_math_verify_boxed_and_gsm8k(math_scorer):
    completions = [
        r"The total is \boxed{42}.",  # boxed, right
        r"The total is \boxed{41}.",  # boxed, wrong
        "She sold 48/2 = 24 clips.\n#### 42",  # GSM8K style, right
        "#### 43",  # GSM8K style, wrong
        r"\boxed{0.5}",  # equivalent form of 1/2
        r"\boxed{41} ... wait, \boxed{42}",  # the final answer is the last box
        r"\boxed{42} ... wait, \boxed{41}",
        "I have no idea",
        r"\boxed{1+x^2}",
    ]
    answers = ["42", "42", "42", "42", r"\frac{1}{2}", "42", "42", "42", "x^2+1"]
    rewards, info = math_scorer.score(completions, answers)
    assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert info["timeouts"] == 0 and info["errors"] == 0 and info["n"] == len(completions)


def test_math_reward_in_process_matches():
    assert math_reward("#### 1,000", "1000") == 1.0
    assert math_reward(r"\boxed{\dfrac{3}{4}}", "0.75") == 1.0


def test_exact_match():
    with RewardScorer("exact", timeout_s=5.0, num_workers=2) as s:
        rewards, info = s.score(["579", " 579\n", "0579", "579=579", "57"], ["579"] * 5)
    assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert info["errors"] == info["timeouts"] == 0


def test_import_path_reward_gets_record():
    with RewardScorer(f"{HERE}:length_reward", timeout_s=5.0, num_workers=1) as s:
        rewards, _ = s.score(["abc", "hello"], ["", ""], records=[None, {"bonus": 0.5}])
    assert rewards == [3.0, 5.5]


def test_bad_reward_spec_fails_fast():
    with pytest.raises(ValueError):
        RewardScorer("not-a-path")
    with pytest.raises(ModuleNotFoundError):
        RewardScorer("no_such_module_xyz:fn")
    with RewardScorer("exact", num_workers=1) as s, pytest.raises(ValueError):
        s.score(["a"], ["a", "b"])


def test_hanging_verifier_times_out_and_scorer_recovers():
    timeout = 1.0
    with RewardScorer(f"{HERE}:misbehaving_reward", timeout_s=timeout, num_workers=2) as s:
        t0 = time.monotonic()
        rewards, info = s.score(["a", "hang", "b", "hang", "c"], ["a", "x", "b", "x", "c"])
        elapsed = time.monotonic() - t0
        assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert info["failures_by_kind"] == {"timeout": 2} and info["timeouts"] == 2 and info["errors"] == 0
        # The hangs were cut at ~timeout (side by side); the slack is for replacement workers
        # starting on a loaded machine. Without the timeout this call would never return.
        assert elapsed < timeout + 15.0
        assert s.totals["restarts"] == 2
        # The killed workers were replaced: the next call works and sees no stale results.
        rewards, info = s.score(["a", "b", "z"], ["a", "b", "c"])
        assert rewards == [1.0, 1.0, 0.0] and info["timeouts"] == 0 and info["failures_by_kind"] == {}


def test_every_failure_kind_is_counted_with_its_record():
    completions = ["a", "crash", "raise", "nan", "inf", "string", "none", "b", "hang"]
    records = [{"id": f"q{i}"} for i in range(len(completions))]
    with RewardScorer(f"{HERE}:misbehaving_reward", timeout_s=2.0, num_workers=2, max_error_frac=1.0) as s:
        rewards, info = s.score(completions, ["a", "", "", "", "", "", "", "b", ""], records)
        assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        assert info["failures_by_kind"] == {
            "worker-died": 1,
            "raised": 1,
            "non-finite": 2,
            "non-numeric": 2,
            "timeout": 1,
        }
        assert info["failed"] == 7 and info["timeouts"] == 1 and info["errors"] == 6
        first = info["first_failures"]
        assert len(first) == 5 and all(m.startswith("record q") and "\n" not in m for m in first)
        expected = {
            "q1": "worker-died: the worker process exited (code 7) during the check",
            "q2": "raised: RuntimeError: verifier bug",
            "q3": "non-finite: returned nan",
            "q4": "non-finite: returned -inf",
            "q5": "non-numeric: returned str '1', expected a real number",
            "q6": "non-numeric: returned NoneType 'None', expected a real number",
            "q8": "timeout: no result within timeout_s=2.0s (worker replaced)",
        }
        for m in first:  # which five come first depends on the workers' timing
            rid = m.split(":")[0].removeprefix("record ")
            assert m == f"record {rid}: {expected[rid]}", m
        # The pool kept working after the crash and the timeout: the next call is clean.
        rewards, info = s.score(["q"], ["q"])
        assert rewards == [1.0] and info["failed"] == 0
        assert s.totals["by_kind"]["non-numeric"] == 2 and s.totals["failed"] == 7


def test_too_many_failures_raise_with_counts_and_first_messages():
    records = [{"id": "p7"}, {"id": "p8"}, {"id": "p9"}]
    with RewardScorer(f"{HERE}:misbehaving_reward", timeout_s=5.0, num_workers=1, max_error_frac=0.5) as s:
        _, info = s.score(["string", "a", "b"], ["", "a", "b"], records)  # 1 of 3 failed: allowed
        assert info["failures_by_kind"] == {"non-numeric": 1}
        assert info["first_failures"] == ["record p7: non-numeric: returned str '1', expected a real number"]
        with pytest.raises(RewardFailureError) as e:
            s.score(["string", "nan", "b"], ["", "", "b"], records)  # 2 of 3: over the limit
    msg = str(e.value)
    assert "\n" not in msg and "2 of 3 checks failed" in msg and "max_error_frac=0.5" in msg, msg
    assert "non-numeric 1, non-finite 1" in msg and "record p8: non-finite: returned nan" in msg, msg
    assert e.value.info["failures_by_kind"] == {"non-numeric": 1, "non-finite": 1}
    with pytest.raises(ValueError, match="max_error_frac"):
        RewardScorer("exact", max_error_frac=1.5)


def test_always_hanging_verifier_costs_one_call_budget_not_a_timeout_per_completion():
    """Without a per-call deadline this call would take ceil(n / workers) * timeout = 10 s (each
    round of hung checks waits a full timeout); with it, one round times out and the rest are cut
    when the call's budget (2 x timeout with no healthy checks measured) runs out."""
    n, workers, timeout = 40, 2, 0.5
    with RewardScorer(f"{HERE}:always_hangs", timeout_s=timeout, num_workers=workers, max_error_frac=1.0) as s:
        t0 = time.monotonic()
        rewards, info = s.score(["x"] * n, ["y"] * n)
        elapsed = time.monotonic() - t0
    per_completion_cost = math.ceil(n / workers) * timeout
    assert rewards == [0.0] * n and info["failed"] == n
    assert info["budget_s"] == 2 * timeout
    kinds = info["failures_by_kind"]
    assert set(kinds) <= {"timeout", "deadline"} and kinds["timeout"] <= workers and kinds["deadline"] >= n - workers
    assert elapsed < per_completion_cost / 2, (elapsed, per_completion_cost)


def test_crashing_verifier_is_an_error_and_scorer_recovers():
    with RewardScorer(f"{HERE}:misbehaving_reward", timeout_s=10.0, num_workers=2, max_error_frac=1.0) as s:
        rewards, info = s.score(["a", "crash", "raise", "nan", "b"], ["a", "", "", "", "b"])
        assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
        assert info["errors"] == 3 and info["timeouts"] == 0
        assert info["failures_by_kind"] == {"worker-died": 1, "raised": 1, "non-finite": 1}
        rewards, info = s.score(["crash", "q"], ["", "q"])
        assert rewards == [0.0, 1.0] and info["failures_by_kind"] == {"worker-died": 1}
        rewards, info = s.score(["q"], ["q"])
        assert rewards == [1.0] and info["errors"] == 0
