"""rollout.top_k and rollout.stop through RolloutEngine.generate, on the tiny model.

What vLLM (0.32) does with a stop string, measured here: the completion ends at the token that
completes it (finish_reason "stop", no eos); its token ids and log-probs are exactly those of the
same request without stop strings, cut there (a prefix: same tokens, same log-probs); the ids
decode to text ending with the stop string (vLLM cuts it only from its own text, which the
trainer does not use). So what trains is what was sampled, and rewards see the stop string.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    res = subprocess.run(
        [sys.executable, str(REPO / "tests" / "dist" / "workers" / "engine" / "sampling_check.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_stop_strings_cut_ids_and_logprobs_at_the_stop_string(report):
    cut_somewhere = 0
    for case in report["stop"]:
        stop = case["stop"]
        for p in case["pairs"]:
            k = len(p["cut_ids"])
            assert p["free_ids"][:k] == p["cut_ids"] and len(p["cut_logprobs"]) == k
            assert p["cut_logprobs"] == pytest.approx(p["free_logprobs"][:k], abs=1e-5)
            first = min((p["free_text"].find(s) + len(s) for s in stop if s in p["free_text"]), default=None)
            if first is None:  # no stop string: the completion is untouched
                assert p["cut_ids"] == p["free_ids"]
            elif p["cut_ids"] != p["free_ids"]:
                cut_somewhere += 1
                assert p["finish"] == "stop" and p["cut_text"] == p["free_text"][:first]
                assert any(p["cut_text"].endswith(s) for s in stop)
    assert cut_somewhere > 50  # the check is not vacuous


def test_top_k_1_is_greedy(report):
    """top_k=1 leaves one token to sample from: every sample is the greedy completion."""
    for greedy, pair in zip(report["greedy"], report["top1"]):
        assert pair == [greedy, greedy]
    assert any(s[0] != g for s, g in zip(report["sampled"], report["greedy"]))  # plain sampling differs
