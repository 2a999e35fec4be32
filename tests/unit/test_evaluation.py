"""Validation metrics (avg@n, pass@k, maj@n) and the validation pass, with a fake generate
function (no vLLM): checked against exact enumeration and an independent recomputation from the dump."""

import itertools
import json
import math
import random
import threading
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import pytest

from megatron_dppo.config import load_config
from megatron_dppo.data.prompts import PromptRenderer, load_records
from megatron_dppo.data.tasks import as_layout, make_splits, write_jsonl, write_parquet
from megatron_dppo.rollout.validation import (
    EvalSet,
    eval_set_paths,
    extract_answer,
    load_eval_sets,
    majority_correct,
    metrics_from_rows,
    pass_at_k,
    run_validation,
)

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = str(REPO / "examples" / "tiny" / "model")


def _enumerated_pass_at_k(correct: list[bool], k: int) -> Fraction:
    """The fraction of k-subsets of the samples with a correct one: what pass@k estimates."""
    subsets = list(itertools.combinations(correct, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


def test_pass_at_k_equals_exact_enumeration_over_all_k_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_enumerated_pass_at_k(correct, k)), abs=1e-12)
    # Large n: the product form stays accurate where C(n, k) is astronomically large (exact rationals).
    for n, c, k in ((1000, 3, 500), (1000, 997, 2), (512, 1, 256), (200, 0, 100)):
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)


def test_majority_vote_ties_and_empty_answers():
    assert majority_correct(["7", "7", "8"], [True, True, False]) == 1.0
    assert majority_correct(["7", "8", "8"], [True, False, False]) == 0.0
    # A tie is the mean over the tied answers (a random tie-break's expectation), whatever their order.
    assert majority_correct(["7", "8"], [True, False]) == 0.5 == majority_correct(["8", "7"], [False, True])
    assert majority_correct(["1", "2", "3", "3", "2"], [False, True, False, False, True]) == 0.5
    # Empty answers do not vote; no answer at all scores 0.
    assert majority_correct(["", "", "5"], [False, False, True]) == 1.0
    assert majority_correct(["", ""], [False, False]) == 0.0


def test_extract_answer_reads_the_final_answer():
    assert extract_answer(" 579\n") == "579"
    assert extract_answer("so \\boxed{12} or \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_answer("work\n#### 42") == "42"
    assert extract_answer("<think>maybe \\boxed{3}</think> it is \\boxed{4}") == "4"
    assert extract_answer("<think>\\boxed{3}</think>5") == "5"  # after the thinking block only
    assert extract_answer("<think>\\boxed{3} and then") == ""  # never closed: no answer


@dataclass
class FakeCompletion:
    token_ids: list
    finish_reason: str


def _fake_generate(tokenizer, calls=None):
    """A 'model' that reads "a+b=" and answers a+b (sometimes a+b+1, or nothing), from the seed alone:
    the same prompt and seed give the same completions on any engine."""

    def generate(prompt_ids, *, n, temperature, top_p, seeds):
        if calls is not None:
            calls.append({"n": n, "temperature": temperature, "top_p": top_p, "seeds": list(seeds)})
        out = []
        for ids, seed in zip(prompt_ids, seeds):
            a, b = map(int, tokenizer.decode(ids, skip_special_tokens=True).rstrip("=").split("+"))
            group = []
            for k in range(n):
                rng = random.Random(seed + k)
                answer = rng.choice([str(a + b), str(a + b), str(a + b + 1), ""])
                ids_k = tokenizer(answer, add_special_tokens=False)["input_ids"]
                group.append(FakeCompletion(ids_k + [tokenizer.eos_token_id], "stop"))
            out.append(group)
        return out

    return generate


class FakeScorer:
    """Exact match, as the 'exact' reward kind scores (no worker processes)."""

    def __init__(self):
        self.calls = 0

    def score(self, texts, answers, records):
        self.calls += 1
        assert len(texts) == len(answers) == len(records)
        return [1.0 if t.strip() == a else 0.0 for t, a in zip(texts, answers)], {}


@pytest.fixture(scope="module")
def renderer():
    from transformers import AutoTokenizer

    return PromptRenderer(AutoTokenizer.from_pretrained(TINY_MODEL), "chat")  # verl rows are chats


def _sets(tmp_path):
    """Set "mix": a verl Parquet with two data sources; set "plain": native JSONL, no source."""
    add = make_splits("add3", seed=2, train=9)["train"]
    mix = str(tmp_path / "mix.parquet")
    write_parquet(as_layout(add[:5], "verl", "src-a") + as_layout(add[5:], "verl", "src-b"), mix)
    plain = str(tmp_path / "plain.jsonl")
    write_jsonl(make_splits("add2", seed=2, train=4)["train"], plain)
    return [EvalSet("mix", mix, load_records(mix)), EvalSet("plain", plain, load_records(plain))]


def _recompute(rows, pass_k):
    """The metrics from the dump, written independently: counts per prompt, enumeration for pass@k,
    a vote count for maj@n."""
    prompts = {}
    for r in rows:
        prompts.setdefault((r["set"], r["index"]), []).append(r)
    per_group = {}
    for (set_name, _), samples in prompts.items():
        n = len(samples)
        correct = [s["reward"] >= 1 - 1e-6 for s in samples]
        votes = Counter(s["extracted"] for s in samples if s["extracted"])
        best = max(votes.values(), default=0)
        tied = [a for a, v in votes.items() if v == best]
        maj = (
            sum(sum(c for s, c in zip(samples, correct) if s["extracted"] == a) / best for a in tied) / len(tied)
            if tied
            else 0.0
        )
        values = {f"avg@{n}": sum(correct) / n, f"maj@{n}": maj}
        values.update({f"pass@{k}": float(_enumerated_pass_at_k(correct, k)) for k in pass_k})
        per_group.setdefault(f"val/{set_name}/all", []).append(values)
        if any(r["data_source"] for r in rows if r["set"] == set_name):  # unnamed ones are "unknown" there
            per_group.setdefault(f"val/{set_name}/{samples[0]['data_source'] or 'unknown'}", []).append(values)
    return {f"{g}/{m}": sum(v[m] for v in vals) / len(vals) for g, vals in per_group.items() for m in vals[0]}


def _eval_cfg(**kw):
    return load_config(None, [f"eval.{k}={v}" for k, v in kw.items()], check=False).eval


def test_validation_metrics_equal_a_recomputation_from_the_dump(tmp_path, renderer):
    sets = _sets(tmp_path)
    cfg = _eval_cfg(n=6, temperature=1.0, top_p=0.9, pass_k="[1,2,6]")
    calls, scorer = [], FakeScorer()
    gen = _fake_generate(renderer.tokenizer, calls)
    metrics = run_validation(
        sets, generate=gen, scorer=scorer, renderer=renderer, cfg=cfg, step=7, dump_dir=str(tmp_path / "val"), seed=3
    )
    rows = [json.loads(line) for line in open(tmp_path / "val" / "step_000007.jsonl")]
    assert len(rows) == 6 * (9 + 4)  # every answer of every prompt of every set
    assert calls[0]["n"] == 6 and calls[0]["temperature"] == 1.0 and calls[0]["top_p"] == 0.9
    assert len(set(calls[0]["seeds"])) == 13  # a seed per prompt
    expected = _recompute(rows, [1, 2, 6])
    assert {k: v for k, v in metrics.items() if k.startswith("val/")} == pytest.approx(expected, abs=1e-12)
    assert set(expected) == {
        f"val/{g}/{m}"
        for g in ("mix/all", "mix/src-a", "mix/src-b", "plain/all")
        for m in ("avg@6", "maj@6", "pass@1", "pass@2", "pass@6")
    }
    assert metrics["eval/accuracy"] == metrics["val/mix/all/avg@6"] == pytest.approx(metrics["val/mix/all/pass@1"])
    assert 0 < metrics["val/mix/all/avg@6"] < metrics["val/mix/all/pass@6"]  # the fake model is imperfect
    # The dump says what the model answered, for whom, and how it was scored.
    r = rows[0]
    assert (r["set"], r["data_source"], r["prompt_id"], r["prompt"]) == (
        "mix",
        "src-a",
        "src-a/0",
        "<bos>" + sets[0].records[0].messages[0]["content"],  # the rendered prompt (tiny chat template)
    )
    assert r["reward"] == float(r["completion"].strip() == r["answer"]) and r["finish_reason"] == "stop"
    # Seeds do not depend on the step: the next validation samples the same way.
    again = run_validation(sets, generate=gen, scorer=scorer, renderer=renderer, cfg=cfg, step=8, dump_dir=None, seed=3)
    assert again == metrics and calls[1]["seeds"] == calls[0]["seeds"]


def test_validation_split_over_engines_gives_the_one_engine_result(tmp_path, renderer):
    """Three engines (threads standing in for ranks, one collective gather between them): each
    generates a contiguous slice, only leaders score, every rank gets the same metrics."""
    sets = _sets(tmp_path)
    cfg = _eval_cfg(n=4, temperature=1.0, pass_k="[1,4]")
    gen = _fake_generate(renderer.tokenizer)
    single = run_validation(sets, generate=gen, scorer=FakeScorer(), renderer=renderer, cfg=cfg, step=1, dump_dir=None)
    ranks, per_engine = 6, 2  # rollout_tp = 2: ranks (0, 1) share engine 0, ...
    barrier, box, results = threading.Barrier(ranks), [None] * ranks, [None] * ranks

    def gather_for(rank):
        def gather(obj):
            box[rank] = obj
            barrier.wait()
            out = list(box)
            barrier.wait()
            return out

        return gather

    def rank_main(rank):
        results[rank] = run_validation(
            sets,
            generate=gen,
            scorer=FakeScorer(),
            renderer=renderer,
            cfg=cfg,
            step=1,
            dump_dir=str(tmp_path / "val") if rank == 0 else None,
            engine_index=rank // per_engine,
            num_engines=ranks // per_engine,
            engine_leader=rank % per_engine == 0,
            gather=gather_for(rank),
            is_main=rank == 0,
        )

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r == single for r in results)
    rows = [json.loads(line) for line in open(tmp_path / "val" / "step_000001.jsonl")]
    assert len(rows) == 4 * 13 and [(r["set"], r["index"]) for r in rows[::4]] == [
        (s.name, i) for s in sets for i in range(len(s.records))
    ]


def test_a_scorer_failure_reaches_every_rank(tmp_path, renderer):
    class Broken:
        def score(self, *a):
            raise RuntimeError("verifier crashed")

    sets = _sets(tmp_path)
    with pytest.raises(RuntimeError, match="validation at step 3: verifier crashed"):
        run_validation(
            sets,
            generate=_fake_generate(renderer.tokenizer),
            scorer=Broken(),
            renderer=renderer,
            cfg=_eval_cfg(),
            step=3,
            dump_dir=None,
        )


def test_greedy_default_is_the_old_pass_at_1(tmp_path, renderer):
    """n=1, temperature 0 (the defaults): eval/accuracy is the fraction of prompts answered
    correctly, what Trainer.evaluate returned."""
    sets = _sets(tmp_path)
    cfg = _eval_cfg()
    assert (cfg.n, cfg.temperature, cfg.pass_k) == (1, 0.0, [1])
    m = run_validation(
        sets,
        generate=_fake_generate(renderer.tokenizer),
        scorer=FakeScorer(),
        renderer=renderer,
        cfg=cfg,
        step=0,
        dump_dir=str(tmp_path),
    )
    rows = [json.loads(line) for line in open(tmp_path / "step_000000.jsonl")]
    mix = [r for r in rows if r["set"] == "mix"]
    assert m["eval/accuracy"] == sum(r["completion"].strip() == r["answer"] for r in mix) / len(mix)
    assert m["val/mix/all/avg@1"] == m["val/mix/all/maj@1"] == m["eval/accuracy"]
    assert m["val/mix/all/pass@1"] == pytest.approx(m["eval/accuracy"])


def test_eval_sets_from_config(tmp_path, renderer):
    sets = _sets(tmp_path)
    cfg = load_config(
        None,
        [
            f"data.eval={sets[1].path}",
            f"eval.sets={{mix: {sets[0].path}}}",
            "trainer.eval_size=3",
        ],
        check=False,
    )
    assert eval_set_paths(cfg) == {"eval": sets[1].path, "mix": sets[0].path}
    loaded = load_eval_sets(cfg, renderer, max_prompt_tokens=20, skip=False, limit_desc="")
    assert [(s.name, [r.id for r in s.records]) for s in loaded] == [
        ("eval", [r.id for r in sets[1].records[:3]]),
        ("mix", ["src-a/0", "src-a/1", "src-a/2"]),
    ]
    warnings = []
    unknown = [{"prompt": "héllo wörld", "answer": "2"}, {"prompt": "1+1=", "answer": "2"}]
    write_jsonl(unknown, str(tmp_path / "u.jsonl"))
    cfg.eval.sets = {"unk": str(tmp_path / "u.jsonl")}
    load_eval_sets(cfg, renderer, max_prompt_tokens=20, skip=False, limit_desc="", warnings=warnings)
    assert len(warnings) == 1 and "1 prompt(s) of" in warnings[0] and "u.jsonl:line 1" in warnings[0], warnings
    write_jsonl([{"prompt": "1+1=", "answer": "2", "data_source": "all"}], str(tmp_path / "all.jsonl"))
    cfg.eval.sets = {"bad": str(tmp_path / "all.jsonl")}
    with pytest.raises(ValueError, match=r"all\.jsonl:line 1: data_source 'all' is reserved"):
        load_eval_sets(cfg, renderer, max_prompt_tokens=20, skip=False, limit_desc="")


def test_metrics_from_rows_by_hand():
    """Two prompts of one source, n=2: (1 of 2 correct, tie), (0 of 2)."""
    rows = [
        dict(set="s", index=0, data_source="x", extracted="1", reward=1.0, correct=True),
        dict(set="s", index=0, data_source="x", extracted="2", reward=0.0, correct=False),
        dict(set="s", index=1, data_source="x", extracted="3", reward=0.0, correct=False),
        dict(set="s", index=1, data_source="x", extracted="3", reward=0.0, correct=False),
    ]
    m = metrics_from_rows(rows, [1, 2], default_set="s")
    assert m["val/s/x/avg@2"] == m["val/s/all/avg@2"] == 0.25 == m["eval/accuracy"]
    assert m["val/s/x/pass@2"] == 0.5 and m["val/s/x/pass@1"] == 0.25
    assert m["val/s/x/maj@2"] == 0.25  # (0.5 for the tie + 0) / 2
    # A record without a data_source, in a set where others have one, is "unknown" (as in the
    # training reward metrics); a set where none has one gets "all" only.
    rows.append(dict(set="s", index=2, data_source="", extracted="4", reward=1.0, correct=True))
    rows.append(dict(set="t", index=0, data_source="", extracted="4", reward=1.0, correct=True))
    m = metrics_from_rows(
        rows[:4] + [dict(rows[4], index=2), dict(rows[4], index=2, extracted="5", correct=False)] + [rows[5]] * 2, [1]
    )
    assert (
        m["val/s/unknown/avg@2"] == 0.5 and m["val/s/x/avg@2"] == 0.25 and m["val/s/all/avg@2"] == pytest.approx(1 / 3)
    )
    assert m["val/t/all/avg@2"] == 1.0 and not [k for k in m if k.startswith("val/t/") and "/all/" not in k]
