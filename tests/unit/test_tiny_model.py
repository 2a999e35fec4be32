"""The committed tiny main-job assets (examples/tiny, built by tools/make_tiny_model.py)."""

import json
import os

import pytest
import torch

from megatron_dppo.data.prompts import PromptRenderer, load_records
from megatron_dppo.rewards.verifiers import exact_match

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "tiny")
MODEL = os.path.join(ROOT, "model")


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    return tok, model


def test_config_matches_the_design(tiny):
    tok, model = tiny
    c = model.config
    assert c.model_type == "qwen3" and c.tie_word_embeddings
    assert (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
    ) == (128, 3, 4, 2, 32, 512)
    assert c.vocab_size == len(tok) == 21
    assert 0.7e6 < sum(p.numel() for p in model.parameters()) < 0.8e6


def test_tokenizer_round_trip(tiny):
    tok, _ = tiny
    ids = tok("123+456=579")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len("123+456=579")  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == "123+456=579"
    assert tok.decode(ids[1:] + [tok.eos_token_id], skip_special_tokens=True) == "123+456=579"
    # The chat template gives the same ids as raw text, so either prompt mode works for the tiny job.
    rec = load_records(os.path.join(ROOT, "data", "test.jsonl"))[0]
    assert PromptRenderer(tok, "chat").token_ids(rec) == PromptRenderer(tok, "raw").token_ids(rec)


def test_data_files():
    train = load_records(os.path.join(ROOT, "data", "train.jsonl"))
    test = load_records(os.path.join(ROOT, "data", "test.jsonl"))
    assert len(train) == 20000 and len(test) == 500
    assert not {r.prompt for r in train} & {r.prompt for r in test}


def test_greedy_heldout_accuracy_is_well_above_chance(tiny):
    tok, model = tiny
    records = load_records(os.path.join(ROOT, "data", "test.jsonl"))[:100]
    enc = tok([r.prompt for r in records], return_tensors="pt")  # equal lengths: no padding needed
    with torch.no_grad():
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    acc = sum(exact_match(t, r.answer) for t, r in zip(texts, records)) / len(records)
    # Chance is ~0 (a 3-4 digit string). The warm-up stopped at ~0.30 on a validation split.
    assert acc > 0.15, (acc, texts[:5])
    with open(os.path.join(MODEL, "warmup.json")) as f:
        assert json.load(f)["reached_threshold"]


# ----------------------------------------------------------------- the long-tailed task (mulsteps)

LONGTAIL = os.path.join(ROOT, "longtail")


@pytest.fixture(scope="module")
def longtail():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(LONGTAIL, "model")
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_longtail_data_and_tokenizer(longtail):
    """Disjoint splits of worked multiplications whose solutions are right, in the model's
    vocabulary; the gold solution lengths are long-tailed (independent of the model)."""
    from megatron_dppo.data.tasks import final_answer_reward, get_task

    tok, model = longtail
    task = get_task("mulsteps")
    train = load_records(os.path.join(LONGTAIL, "train.jsonl"))
    test = load_records(os.path.join(LONGTAIL, "test.jsonl"))
    assert len(train) == 8000 and len(test) == 500
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    for r in test:
        a, b = (int(x) for x in r.prompt[:-1].split("*"))
        steps = r.extra["solution"].split(",")
        assert steps == [f"{j}:{j * a}" for j in range(2, b + 1)] and r.answer == str(a * b)
        assert final_answer_reward(r.extra["solution"], r.answer) == 1.0
    ids = tok(test[0].prompt + test[0].extra["solution"])["input_ids"]
    assert tok.unk_token_id not in ids and len(ids) == 1 + len(test[0].prompt + test[0].extra["solution"])
    assert model.config.max_position_embeddings >= 1 + 8 + task.max_solution_chars + 1
    assert (model.config.head_dim, model.config.vocab_size) == (32, len(tok)) == (32, 23)
    gold = torch.tensor([len(r.extra["solution"]) + 1 for r in train], dtype=torch.float64)
    assert gold.std() / gold.mean() > 0.7 and gold.max() / gold.median() > 5


@pytest.mark.slow
def test_longtail_model_is_long_tailed_and_partly_right(longtail):
    """Greedy completions of the committed model on 100 held-out problems: coefficient of
    variation of their lengths >= 0.5, max/median >= 4 (issue 13's bar; measured on all 500 at
    the warm-up: 0.90 and 5.6), accuracy between 20% and 45% (measured: 0.306 on 500)."""
    from collections import defaultdict

    from megatron_dppo.data.tasks import final_answer_reward

    tok, model = longtail
    records = load_records(os.path.join(LONGTAIL, "test.jsonl"))[:100]
    by_len = defaultdict(list)
    for r in records:  # equal prompt lengths batch without padding
        by_len[len(r.prompt)].append(r)
    lengths, correct = [], 0.0
    for group in by_len.values():
        enc = tok([r.prompt for r in group], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **enc, do_sample=False, max_new_tokens=134, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
            )
        for r, row in zip(group, out[:, enc["input_ids"].shape[1] :].tolist()):
            n = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            lengths.append(n)
            correct += final_answer_reward(tok.decode(row[:n], skip_special_tokens=True), r.answer)
    t = torch.tensor(lengths, dtype=torch.float64)
    cv, tail = float(t.std(unbiased=False) / t.mean()), float(t.max() / t.median())
    assert cv >= 0.5 and tail >= 4, (cv, tail, lengths)
    assert 0.2 <= correct / len(records) <= 0.45, correct
    with open(os.path.join(LONGTAIL, "model", "warmup.json")) as f:
        warm = json.load(f)
    assert warm["reached_threshold"] and warm["task"] == "mulsteps"
    assert warm["test_completion_tokens_sampled_t1"]["cv"] >= 0.5


def test_mulsteps_task_rules():
    """The worked task's rules, written out: steps, answer, the 1/(b-1) draw, the verifier."""
    import random
    from collections import Counter

    from megatron_dppo.data.tasks import final_answer, final_answer_reward, get_task, make_splits

    t = get_task("mulsteps")
    assert t.record(47, 4) == {"prompt": "47*4=", "answer": "188", "solution": "2:94,3:141,4:188"}
    assert t.max_solution_chars == len(t.solution(9999, 16)) == 132
    rng = random.Random(0)
    draws = Counter(t.draw(rng)[1] for _ in range(20000))
    assert set(draws) == set(range(2, 17))
    assert abs(draws[2] / draws[3] - 2.0) < 0.15 and abs(draws[2] / draws[16] - 15.0) < 4  # P(b) ~ 1/(b-1)
    assert final_answer(" 2:94,3:141 ") == "141" and final_answer("188") == "188"
    assert final_answer_reward("2:94,3:141,4:188", "188") == 1.0
    assert final_answer_reward("2:94,3:141,4:18", "188") == 0.0 and final_answer_reward("", "188") == 0.0
    s = make_splits("mulsteps", seed=0, train=50, test=10)
    assert s == make_splits("mulsteps", seed=0, train=50, test=10) and s["train"][0]["id"] == "mulsteps-000000"
