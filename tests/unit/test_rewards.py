import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest

from megatron_dppo.config import load_config
from megatron_dppo.rewards import (
    RewardFailureError,
    RewardScorer,
    answer_after_thinking,
    exact_reward,
    gsm8k_final,
    last_boxed,
    math_reward,
    overlong_penalty,
    reward_metrics_by_source,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def dict_reward(completion, answer, record):
    return {
        "ok": {"score": 1.0, "acc": 1.0, "format": 0.5},
        "int-score": {"score": 0, "acc": True},
        "no-score": {"acc": 1.0},
        "str-extra": {"score": 1.0, "acc": "yes"},
        "nan-extra": {"score": 1.0, "acc": math.nan},
        "mean-extra": {"score": 1.0, "mean": 0.1},
        "str-score": {"score": "1"},
    }[completion]


def batched_reward(completions, answers, records):
    """One result per completion; the extras say which call (its size, its process) scored it."""
    if "raise" in completions:
        raise RuntimeError("service unavailable")
    if "short" in completions:
        return [1.0] * (len(completions) - 1)
    if "hang" in completions:
        time.sleep(1e9)
    out = []
    for c, a in zip(completions, answers):
        out.append(math.nan if c == "nan" else {"score": float(c == a), "batch": len(completions), "pid": os.getpid()})
    return out


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
    with pytest.raises(ValueError, match="config key 'reward.kind': expected one of"):
        RewardScorer("not-a-path")
    with pytest.raises(ValueError, match="config key 'reward.kind': cannot import module 'no_such_module_xyz'"):
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
    # The budget is 2 x timeout: one round of hung checks times out, a second one may start before
    # the budget runs out and time out at it (seen under make test's load); the rest are cut.
    rounds = 2
    assert set(kinds) <= {"timeout", "deadline"}, kinds
    assert kinds["timeout"] <= rounds * workers and kinds["deadline"] >= n - rounds * workers, kinds
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


# ---------------------------------------------------------------------------- thinking templates


def test_answer_after_thinking():
    assert answer_after_thinking("<think>a</think> b </think> c") == " c"
    assert answer_after_thinking("reasoning (the template opened <think>) </think>#### 4") == "#### 4"
    assert answer_after_thinking("<think> never closed, \\boxed{4}") is None
    assert answer_after_thinking("no block \\boxed{4}") == "no block \\boxed{4}"


def test_math_reads_the_answer_after_the_thinking_block(math_scorer):
    completions = [
        "<think>maybe \\boxed{41}? no.</think> So:\n#### 42",  # the box inside the thinking is not the answer
        "<think>it is \\boxed{42}</think> The answer is \\boxed{41}.",
        "<think>so \\boxed{42}, let me check again",  # ran out of tokens while thinking: no answer
        "it's 6*7 (the template opened the block) </think>\n\\boxed{42}",
        "\\boxed{42}",  # no thinking at all
    ]
    rewards, info = math_scorer.score(completions, ["42"] * len(completions))
    # Reference: math-verify on the answer part cut out by hand (the unclosed block has none).
    answers = [" So:\n#### 42", " The answer is \\boxed{41}.", None, "\n\\boxed{42}", "\\boxed{42}"]
    assert rewards == [0.0 if a is None else math_reward(a, "42") for a in answers] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert info["failed"] == 0  # an unclosed block is a wrong answer, not a verifier failure


# ---------------------------------------------------------------------------- routing, specs, results


def test_routing_by_data_source_matches_each_function_in_process(tmp_path):
    (tmp_path / "file_reward.py").write_text(
        "def halves(completion, answer, record):\n    return len(completion) / 2\n"
    )
    by_source = {"lengths": f"{HERE}:length_reward", "files": f"{tmp_path}/file_reward.py:halves"}
    completions = ["7", "abc", "hello", "7", "xy", "8"]
    answers = ["7", "", "", "7", "", "7"]
    records = [
        {"data_source": "exact-src"},  # not in by_source: the default kind
        {"data_source": "lengths", "bonus": 0.5},
        SimpleNamespace(id="ns", data_source="files"),  # a PromptRecord-like object
        None,  # no record: the default kind
        {"data_source": "files"},
        SimpleNamespace(id="plain"),  # no data_source attribute: the default kind
    ]
    with RewardScorer("exact", timeout_s=5.0, num_workers=2, by_source=by_source) as s:
        rewards, info = s.score(completions, answers, records)
    reference = [exact_reward("7", "7"), length_reward("abc", "", records[1]), 2.5, 1.0, 1.0, 0.0]
    assert rewards == reference == [1.0, 3.5, 2.5, 1.0, 1.0, 0.0]
    assert info["failed"] == 0 and info["extras"] == [{}] * 6


def test_file_path_reward_relative_to_cwd_with_dict_extras(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "verl_reward.py").write_text(
        "def compute_score(solution_str, ground_truth, extra_info=None):\n"
        "    acc = float(solution_str.strip() == ground_truth)\n"
        "    return {'score': acc - 0.5 * (len(solution_str) > 3), 'acc': acc}\n"
    )
    monkeypatch.chdir(tmp_path)
    with RewardScorer("sub/verl_reward.py:compute_score", timeout_s=5.0, num_workers=1) as s:
        assert s.kind == f"{tmp_path}/sub/verl_reward.py:compute_score"  # stored absolute
        rewards, info = s.score(["42", "4242", "41"], ["42", "42", "42"])
    assert rewards == [1.0, -0.5, 0.0]
    assert info["extras"] == [{"acc": 1.0}, {"acc": 0.0}, {"acc": 0.0}] and info["failed"] == 0


def test_dict_results_and_each_malformed_dict_is_a_counted_failure():
    completions = ["ok", "int-score", "no-score", "str-extra", "nan-extra", "mean-extra", "str-score"]
    records = [{"id": c} for c in completions]
    with RewardScorer(f"{HERE}:dict_reward", timeout_s=5.0, num_workers=2, max_error_frac=1.0) as s:
        rewards, info = s.score(completions, [""] * len(completions), records)
        assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        assert info["extras"] == [{"acc": 1.0, "format": 0.5}, {"acc": 1.0}, {}, {}, {}, {}, {}]
        assert info["failures_by_kind"] == {"bad-dict": 4, "non-numeric": 1}
        messages = info["first_failures"]
        assert sorted(messages) == sorted(
            [
                "record no-score: bad-dict: returned a dict without 'score' (keys ['acc'])",
                "record str-extra: bad-dict: extra 'acc' is str 'yes', expected a real number",
                "record nan-extra: bad-dict: extra 'acc' is nan",
                "record mean-extra: bad-dict: extra key 'mean': expected a non-empty str other than 'mean' "
                "(reward/<source>/mean is the reward's)",
                "record str-score: non-numeric: 'score' is str '1', expected a real number",
            ]
        )


def test_batched_reward_is_one_call_per_step_beside_per_completion_kinds():
    completions = ["a", "b", "x", "c", "7", "d", "8"]
    answers = ["a", "b", "y", "c", "7", "d", "7"]
    records = [{"data_source": "svc"}] * 4 + [{"data_source": "exact"}] + [{"data_source": "svc"}] + [None]
    by_source = {"svc": f"{HERE}:batched_reward"}
    with RewardScorer("exact", timeout_s=5.0, num_workers=2, by_source=by_source, batched=True) as s:
        rewards, info = s.score(completions, answers, records)
    assert rewards == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0] and info["failed"] == 0
    svc = [i for i, r in enumerate(records) if r and r["data_source"] == "svc"]
    # All five "svc" completions came from one call in one process; the others were not batched.
    assert {info["extras"][i]["batch"] for i in svc} == {len(svc)}
    assert len({info["extras"][i]["pid"] for i in svc}) == 1
    assert [info["extras"][i] for i in (4, 6)] == [{}, {}]


def test_batched_failures_are_counted_per_completion():
    with RewardScorer(f"{HERE}:batched_reward", timeout_s=5.0, num_workers=2, batched=True, max_error_frac=1.0) as s:
        rewards, info = s.score(["a", "nan", "c"], ["a", "", "x"])  # one bad element fails alone
        assert rewards == [1.0, 0.0, 0.0] and info["failures_by_kind"] == {"non-finite": 1}
        assert info["first_failures"] == ["record #1: non-finite: returned nan"]
        rewards, info = s.score(["a", "short", "c"], ["a", "", "c"])  # a wrong length fails them all
        assert rewards == [0.0] * 3 and info["failures_by_kind"] == {"bad-batch": 3}
        assert info["first_failures"][0] == (
            "record #0: bad-batch: returned a list of 2 for 3 completions, expected a list of 3 results"
        )
        _, info = s.score(["raise", "b"], ["", ""])
        assert info["failures_by_kind"] == {"raised": 2}
        assert info["first_failures"][1] == "record #1: raised: RuntimeError: service unavailable"
        assert s.score(["q"], ["q"])[0] == [1.0]


def test_batched_call_gets_the_timeout_of_its_share_of_the_pool():
    """A batch of m completions runs under timeout_s * ceil(m / num_workers): the time the pool
    would have for the same checks one by one."""
    timeout, workers, m = 0.5, 2, 4
    with RewardScorer(
        f"{HERE}:batched_reward", timeout_s=timeout, num_workers=workers, batched=True, max_error_frac=1.0
    ) as s:
        t0 = time.monotonic()
        rewards, info = s.score(["hang"] * m, [""] * m)
        elapsed = time.monotonic() - t0
        batch_timeout = timeout * math.ceil(m / workers)
        assert rewards == [0.0] * m and info["failures_by_kind"] == {"timeout": m}
        assert info["first_failures"][0] == (
            f"record #0: timeout: no result within the batch's timeout of {batch_timeout:.1f}s "
            f"(timeout_s={timeout}s x {math.ceil(m / workers)}) (worker replaced)"
        )
        assert info["budget_s"] == 2 * timeout + batch_timeout  # no single checks measured: 2 x timeout_s + the batch
        assert batch_timeout <= elapsed < batch_timeout + 10.0, elapsed
        assert s.score(["a"], ["a"])[0] == [1.0]  # the replaced worker serves the next call


def test_bad_reward_spec_names_its_config_key_in_one_line(tmp_path):
    """Issue 24: 'No module named ...' alone did not say which key to fix."""
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    cases = [
        (
            {"kind": "nosuchpkg.mod:fn"},
            "config key 'reward.kind': cannot import module 'nosuchpkg' (from 'nosuchpkg.mod:fn'): "
            "No module named 'nosuchpkg'",
        ),
        (
            {"kind": "exact", "by_source": {"gsm8k": "nosuchpkg.mod:fn"}},
            "config key 'reward.by_source.gsm8k': cannot import module 'nosuchpkg' (from 'nosuchpkg.mod:fn'): "
            "No module named 'nosuchpkg'",
        ),
        (
            {"kind": f"{HERE}:no_such_fn"},
            f"config key 'reward.kind': {HERE!r} has no attribute 'no_such_fn' (from '{HERE}:no_such_fn')",
        ),
        ({"kind": f"{HERE}:HERE"}, f"config key 'reward.kind': '{HERE}:HERE' is a str, expected a function"),
        (
            {"kind": "mth"},
            "config key 'reward.kind': expected one of ['exact', 'math'], 'pkg.module:function' or "
            "'path/to/file.py:function', got 'mth'",
        ),
        (
            {"kind": f"{tmp_path}/nope.py:fn"},
            f"config key 'reward.kind': reward file '{tmp_path}/nope.py' not found (from '{tmp_path}/nope.py:fn')",
        ),
        (
            {"kind": f"{tmp_path}/broken.py:fn"},
            f"config key 'reward.kind': loading reward file '{tmp_path}/broken.py' raised "
            "ZeroDivisionError: division by zero",
        ),
        (
            {"kind": "math", "batched": True},
            "config key 'reward.batched': expected false when every reward kind is built in (['math']): "
            "only a user function can take a batch",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as e:
            RewardScorer(num_workers=1, **kwargs)
        assert str(e.value) == message


def test_user_reward_code_is_imported_only_in_the_workers_under_the_startup_timeout(tmp_path):
    """Issue 33: a reward file that blocks at import hung the trainer (imported in its own process,
    no timeout). Now the caller's process never imports it; a hang is a named RuntimeError after
    startup_timeout_s, a crash at import names the key and file too."""
    blocks, crashes, fine = tmp_path / "blocks.py", tmp_path / "crashes.py", tmp_path / "fine.py"
    blocks.write_text("import time\ntime.sleep(6)\ndef fn(c, a, r):\n    return 0.0\n")
    crashes.write_text("import os\nos._exit(3)\n")
    fine.write_text("def fn(c, a, r):\n    return float(c == a)\n")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        RewardScorer("exact", by_source={"slow": f"{blocks}:fn"}, num_workers=2, startup_timeout_s=2)
    assert str(e.value) == (
        f"config key 'reward.by_source.slow': reward worker importing reward file '{blocks}' (function 'fn'): "
        "did not import within 2 s (code that runs at import and blocks, e.g. a service called without a timeout?)"
    )
    assert time.monotonic() - t0 < 5  # the timeout, not the 6 s sleep of an import in this process
    with pytest.raises(RuntimeError) as e:
        RewardScorer(f"{crashes}:fn", num_workers=1)
    assert str(e.value) == (
        f"config key 'reward.kind': reward worker importing reward file '{crashes}' (function 'fn'): "
        "the worker exited with code 3"
    )
    with RewardScorer(f"{fine}:fn", num_workers=1) as s:
        assert s.score(["a", "b"], ["a", "a"])[0] == [1.0, 0.0]
    # None of these files was imported in this process (another test of this worker may have
    # loaded some other reward file in-process: only the modules of this test's files count).
    ours = {str(blocks), str(crashes), str(fine)}
    assert not [name for name, m in list(sys.modules.items()) if getattr(m, "__file__", None) in ours]


def test_a_reward_whose_signature_cannot_take_the_call_is_refused_at_start(tmp_path):
    """Issue 33: a one-argument function was found only when the first rollout was scored."""
    (tmp_path / "r.py").write_text(
        "def one(completion):\n    return 0.0\ndef three(cs, as_, rs=None):\n    return []\n"
    )
    spec = f"{tmp_path}/r.py:one"
    with pytest.raises(ValueError) as e:
        RewardScorer(spec, num_workers=1)
    assert str(e.value) == (
        f"config key 'reward.kind': {spec!r} has the signature (completion), but is called as "
        "fn(completion, answer, record) (too many positional arguments)"
    )
    with pytest.raises(ValueError, match=r"config key 'reward.by_source.s': .* fn\(completions, answers, records\)"):
        RewardScorer("exact", by_source={"s": spec}, batched=True, num_workers=1)
    with RewardScorer(f"{tmp_path}/r.py:three", batched=True, num_workers=1):
        pass  # (completions, answers, records=None) takes the batched call


def huge_reward(completion, answer, record):
    return {"big": 1e200, "huge-int": 10**400, "ok": 1.0, "dict": {"score": 1.0, "x": -1e39}}[completion]


def test_a_reward_float32_cannot_hold_is_named_with_function_record_and_value():
    """Issue 33: 1e200 is finite in Python and was accepted, then became inf in the float32 rewards
    ("rewards must be finite: found NaN or inf", naming nothing)."""
    spec = f"{HERE}:huge_reward"
    records = [{"id": i} for i in ("a", "b", "c", "d")]
    with RewardScorer("exact", by_source={"s": spec}, num_workers=1, max_error_frac=1.0) as s:
        rewards, info = s.score(
            ["big", "huge-int", "ok", "dict"], [""] * 4, [dict(r, data_source="s") for r in records]
        )
    assert rewards == [0.0, 0.0, 1.0, 0.0]
    assert info["failures_by_kind"] == {"non-finite": 2, "bad-dict": 1}
    assert info["first_failures"] == [
        f"record a ({spec}): non-finite: returned 1e+200, beyond float32's range (|x| <= 3.402823e+38)",
        f"record b ({spec}): non-finite: returned 1{'0' * 59}, beyond float32's range (|x| <= 3.402823e+38)",
        f"record d ({spec}): bad-dict: extra 'x' is -1e+39, beyond float32's range (|x| <= 3.402823e+38)",
    ]
    with RewardScorer(spec, num_workers=1) as s, pytest.raises(RewardFailureError) as e:
        s.score(["big"], [""], records[:1])
    assert str(e.value) == (
        f"reward {spec!r}: 1 of 1 checks failed (100%, over max_error_frac=0.5): non-finite 1; first: "
        "record a: non-finite: returned 1e+200, beyond float32's range (|x| <= 3.402823e+38)"
    )


def test_from_config_builds_the_configured_scorer(tmp_path):
    cfg = load_config(
        overrides=[
            "model.hf_dir=m",
            "data.train=t.jsonl",
            "reward.kind=exact",
            f"reward.by_source.lengths={HERE}:length_reward",
            "reward.num_workers=1",
            "reward.timeout_s=3",
        ]
    )
    with RewardScorer.from_config(cfg.reward) as s:
        assert (s.kind, s.by_source, s.timeout_s, len(s._workers)) == (
            "exact",
            {"lengths": f"{HERE}:length_reward"},
            3.0,
            1,
        )
        assert s.score(["ab", "ab"], ["ab", "x"], [None, {"data_source": "lengths"}])[0] == [1.0, 2.0]


# ---------------------------------------------------------------------------- config keys


def _config(*overrides):
    return load_config(overrides=["model.hf_dir=m", "data.train=t.jsonl", *overrides])


def test_reward_config_keys_are_checked_and_named(tmp_path, monkeypatch):
    with pytest.raises(
        ValueError,
        match=r"config key 'reward.overlong_buffer': expected an integer in \[0, "
        r"rollout.max_new_tokens=64\)",
    ):
        _config("rollout.max_new_tokens=64", "reward.overlong_buffer=64")
    assert _config("rollout.max_new_tokens=64", "reward.overlong_buffer=63").reward.overlong_buffer == 63
    with pytest.raises(ValueError, match="config key 'reward.overlong_penalty': expected a number >= 0"):
        _config("reward.overlong_penalty=-1")
    with pytest.raises(ValueError, match="config key 'reward.by_source.s': expected str, got 3"):
        _config("reward.by_source.s=3")
    with pytest.raises(ValueError, match="config key 'reward.batched': expected false"):
        _config("reward.batched=true", "reward.by_source.s=math")
    # by_source overrides add to what the file (or an earlier override) set.
    cfg = _config("reward.by_source.openai/gsm8k=math", "reward.by_source.tiny=exact")
    assert cfg.reward.by_source == {"openai/gsm8k": "math", "tiny": "exact"}
    # A relative reward file is stored absolute, against the directory the config was read in.
    (tmp_path / "r.py").write_text("def fn(c, a, r):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    cfg = _config("reward.kind=r.py:fn", "reward.by_source.b=./r.py:fn")
    assert cfg.reward.kind == f"{tmp_path}/r.py:fn" and cfg.reward.by_source == {"b": f"{tmp_path}/r.py:fn"}
    with pytest.raises(ValueError) as e:
        _config("reward.by_source.b=missing.py:fn")
    assert str(e.value) == (
        f"config key 'reward.by_source.b': reward file '{tmp_path}/missing.py' not found (from 'missing.py:fn')"
    )
    (tmp_path / "c.yaml").write_text("reward:\n  by_source:\n    a: math\n")
    assert load_config(str(tmp_path / "c.yaml"), ["model.hf_dir=m", "data.train=t"]).reward.by_source == {"a": "math"}


# ---------------------------------------------------------------------------- shaping and metrics


def test_overlong_penalty_matches_dapo_formula():
    """DAPO (Yu et al. 2025) eq. 13 with L_max = max_new_tokens and L_cache = buffer, scaled."""
    L_max, L_cache, factor = 100, 20, 0.5

    def r_length(y):
        if y <= L_max - L_cache:
            return 0.0
        if y <= L_max:
            return ((L_max - L_cache) - y) / L_cache
        return -1.0

    for y in range(0, L_max + 3):
        assert overlong_penalty(y, L_max, L_cache, factor) == pytest.approx(factor * r_length(y), abs=1e-12), y
    # The edges and the middle, by hand.
    assert overlong_penalty(80, L_max, L_cache, factor) == 0.0
    assert overlong_penalty(81, L_max, L_cache, factor) == pytest.approx(-0.5 / 20)
    assert overlong_penalty(90, L_max, L_cache, factor) == pytest.approx(-0.25)
    assert overlong_penalty(100, L_max, L_cache, factor) == pytest.approx(-0.5)
    assert all(overlong_penalty(y, L_max, 0, factor) == 0.0 for y in range(L_max + 3))  # buffer 0: off
    with pytest.raises(ValueError):
        overlong_penalty(5, L_max, L_max, factor)


def test_reward_metrics_by_source_means_by_hand():
    rewards = [1.0, 0.0, 1.0, 0.5, 0.25]
    records = [
        {"data_source": "a"},
        SimpleNamespace(data_source="a"),
        {"data_source": "b"},
        {"id": "no source"},
        None,
    ]
    extras = [{"acc": 1.0}, {"acc": 0.0, "fmt": 1.0}, {}, {"acc": 1.0}, {}]
    assert reward_metrics_by_source(rewards, records, extras) == {
        "reward/a/mean": 0.5,  # (1 + 0) / 2
        "reward/a/acc": 0.5,
        "reward/a/fmt": 1.0,  # only the completion that returned it
        "reward/b/mean": 1.0,
        "reward/unknown/mean": 0.375,  # (0.5 + 0.25) / 2
        "reward/unknown/acc": 1.0,
    }
    assert reward_metrics_by_source(rewards[:2], [None, {"id": 1}], None) == {}  # no sources: nothing new
    with pytest.raises(ValueError):
        reward_metrics_by_source([1.0], [None, None])


# ---------------------------------------------------------------------------- signals (issue 24)


def test_workers_ignore_sigint_and_sigterm_idle_and_mid_check():
    """A Ctrl-C or SIGTERM that reaches a worker neither kills it nor fails a check."""
    with RewardScorer("reward_fixtures:slow_exact", timeout_s=10.0, num_workers=2) as s:
        pids = [w.proc.pid for w in s._workers]
        for pid in pids:  # idle
            os.kill(pid, signal.SIGINT)
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.3)

        def mid_check():
            for pid in pids:
                os.kill(pid, signal.SIGINT)
                os.kill(pid, signal.SIGTERM)

        timer = threading.Timer(0.15, mid_check)
        timer.start()
        rewards, info = s.score(["a", "b", "c", "d"], ["a", "b", "x", "d"])
        timer.join()
        assert rewards == [1.0, 1.0, 0.0, 1.0] and info["failed"] == 0
        assert s.totals["restarts"] == 0 and [w.proc.pid for w in s._workers] == pids
        assert all(w.proc.is_alive() for w in s._workers)


GROUP_SIGNAL_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from megatron_dppo.rewards import RewardScorer

    caught = []
    if __name__ == "__main__":  # (the forkserver and the workers import this file too, as __mp_main__)
        for sig in (signal.SIGINT, signal.SIGTERM):  # the trainer's own handlers: note and go on
            signal.signal(sig, lambda signum, frame: caught.append(signal.Signals(signum).name))
        with RewardScorer("reward_fixtures:slow_exact", timeout_s=10.0, num_workers=2) as s:
            pids = [w.proc.pid for w in s._workers]

            def to_the_group():
                os.killpg(os.getpgrp(), signal.SIGINT)
                time.sleep(0.05)
                os.killpg(os.getpgrp(), signal.SIGTERM)

            timer = threading.Timer(0.15, to_the_group)
            timer.start()
            first, info = s.score(["a", "b", "c", "d"], ["a", "b", "x", "d"])
            timer.join()
            time.sleep(0.3)
            second, info2 = s.score(["e", "f"], ["e", "x"])
            print(json.dumps({
                "first": first, "failed": info["failed"] + info2["failed"], "second": second,
                "restarts": s.totals["restarts"], "same_workers": [w.proc.pid for w in s._workers] == pids,
                "caught": caught,
            }))
    """
)


def forkserver_ignores_sigterm() -> bool:
    from multiprocessing import forkserver

    with open(f"/proc/{forkserver._forkserver._forkserver_pid}/status") as f:
        ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return bool(ignored & (1 << (signal.SIGTERM - 1)))


def test_the_forkserver_ignores_sigterm_and_importing_the_preload_elsewhere_does_nothing():
    import megatron_dppo.rewards.forkserver_signals  # noqa: F401

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # pytest's own handling is untouched
    with RewardScorer("exact", num_workers=1) as s:
        assert s.score(["1"], ["1"])[0] == [1.0]
        assert forkserver_ignores_sigterm()


def test_sigint_and_sigterm_to_the_process_group_leave_the_pool_alone(tmp_path):
    """Ctrl-C (SIGINT) and torchrun's stop (SIGTERM to the rank's process group) reach the trainer,
    the forkserver and every worker at once: no worker traceback, no check lost, the pool goes on."""
    script = tmp_path / "group_signals.py"
    script.write_text(GROUP_SIGNAL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests"), REPO]))
    res = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # its own process group: the signals reach only it and its children
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "KeyboardInterrupt" not in res.stderr, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {
        "first": [1.0, 1.0, 0.0, 1.0],
        "failed": 0,
        "second": [1.0, 0.0],
        "restarts": 0,
        "same_workers": True,
        "caught": ["SIGINT", "SIGTERM"],
    }, (out, res.stderr[-2000:])
