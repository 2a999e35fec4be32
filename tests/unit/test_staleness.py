"""One-step off-policy training with dedicated rollout ranks (trainer.max_staleness=1), its pure
parts: a step's first round drawn a step early trains what the step would have drawn itself, and
the round in flight survives a checkpoint (PendingRound's JSON state) exactly."""

import json
import math
from types import SimpleNamespace

import numpy as np
import torch

from megatron_dppo.algorithms import batch
from megatron_dppo.algorithms.pruning import PromptStats, get_strategy
from megatron_dppo.algorithms.records import Group, RolloutCounts
from megatron_dppo.config import Config
from megatron_dppo.train.step_rollout import EnginePart, PendingRound


class _Prompt:
    def __init__(self, i):
        self.id, self.index = f"q{i}", i


def _method(**pruning):
    cfg = Config()
    cfg.trainer.prompts_per_step, cfg.rollout.group_size = 8, 4
    cfg.algorithm.dynamic_sampling = True  # refill: rounds after the first are drawn in the step
    cfg.pruning.strategy, cfg.pruning.r_q, cfg.pruning.r_o = "dppo", 0.5, 0.5
    cfg.pruning.drop_zero_variance = True
    return batch.Method.from_config(cfg, get_strategy("dppo"))


def _stream(prompts):
    pos = 0

    def next_batch(k):
        nonlocal pos
        pos += k
        return prompts[pos - k : pos]

    return next_batch


def _history(ids):  # half the prompts have a low score: prompt pruning has something to draw on
    score = torch.tensor([0.1 if int(i[1:]) % 2 else 0.9 for i in ids])
    return PromptStats(score=score, zero_var_streak=torch.zeros(len(ids), dtype=torch.long))


def _rollout(rnd, items):
    return [
        Group(rec, rnd, slot, [1], [[2]] * 4, [float(rec.index % 3 == 0 and k == 0) for k in range(4)], prompt_weight=w)
        for rec, slot, w in items
    ]


def _summary(collected, gen):
    return (
        [(g.record.id, g.round, g.slot, g.train_weight, g.minibatch) for g in collected.trained],
        [g.record.id for g in collected.rolled],
        collected.drawn,
        torch.rand(4, generator=gen).tolist(),  # the generator the step continues (completion pruning)
    )


def test_a_first_round_drawn_a_step_early_gives_the_step_the_colocated_run_collects():
    """collect(first_round=...) with round 0 drawn earlier by draw_round on the step's generator
    (what the trainer does while the previous step trains) equals collect drawing it itself: the
    same groups, weights, refill rounds, prompts drawn and generator state afterwards."""
    prompts = [_Prompt(i) for i in range(200)]
    method, strategy = _method(), get_strategy("dppo")
    gen = torch.Generator().manual_seed(5)
    colocated = batch.collect(
        method, strategy, next_batch=_stream(prompts), stats_of=_history, rollout=_rollout, generator=gen
    )
    expected = _summary(colocated, gen)
    assert colocated.drawn > method.prompts_per_round  # refill drew more rounds: the check covers them

    gen, next_batch = torch.Generator().manual_seed(5), _stream(prompts)
    first = batch.draw_round(method, strategy, next_batch, _history, gen)
    early = batch.collect(
        method, strategy, next_batch=next_batch, stats_of=_history, rollout=_rollout, generator=gen, first_round=first
    )
    assert _summary(early, gen) == expected
    # and a first round that is not the one collect would draw shows (the check can fail)
    gen, next_batch = torch.Generator().manual_seed(6), _stream(prompts)
    other = batch.draw_round(method, strategy, next_batch, _history, gen)
    gen = torch.Generator().manual_seed(5)
    wrong = batch.collect(
        method, strategy, next_batch=next_batch, stats_of=_history, rollout=_rollout, generator=gen, first_round=other
    )
    assert _summary(wrong, gen) != expected


def test_a_pending_round_survives_its_checkpoint_state_exactly():
    """PendingRound -> to_state -> JSON text -> from_state: the drawn round, the generator's state,
    the counts and every group's fields (routed experts with their dtype, extras, versions) are
    what they were; a prompt the data no longer has is a named error."""
    records = [_Prompt(i) for i in range(6)]
    rnd = batch.Round(records[:4], torch.tensor([True, False, True, True]), torch.tensor([1.5, 0.0, 1.5, 1.0 / 3]))
    gen = torch.Generator().manual_seed(3)
    torch.rand(7, generator=gen)  # a generator part-way through its stream
    counts = RolloutCounts(prompts_rolled=3, generated_tokens=17, reward_failures={"timeout": 1}, engine_seconds={})
    counts.engine_seconds["rollout"] = 0.25
    group = Group(
        records[2],
        0,
        2,
        [5, 6],
        [[1, 2, 3], [4]],
        [1.0, -0.5],
        prompt_weight=1.5,
        truncated=[False, True],
        sampling_logprobs=[[-0.1, -0.2, -math.pi], [-1e-9]],
        routed_experts=[np.arange(24, dtype=np.int16).reshape(4, 3, 2), np.zeros((2, 3, 2), dtype=np.int16)],
        reward_extras=[{"overlong_penalty": -0.25}, {}],
        prefix_len=1,
        policy_version=6,
    )
    pending = PendingRound(9, rnd, gen, counts, [EnginePart(groups=[group], generated_tokens=4, seconds={"idle": 1.0})])
    state = json.loads(json.dumps(pending.to_state()))
    back = PendingRound.from_state(state, {r.id: r for r in records})
    assert back.step == 9 and back.round.records == rnd.records
    assert torch.equal(back.round.keep, rnd.keep) and torch.equal(back.round.weight, rnd.weight)
    assert torch.equal(torch.rand(5, generator=back.generator), torch.rand(5, generator=gen))
    assert back.counts == counts
    (part,) = back.parts
    assert part.generated_tokens == 4 and part.seconds == {"idle": 1.0}
    (g,) = part.groups
    for name in ("record", "slot", "prompt_ids", "completions", "rewards", "prompt_weight", "truncated"):
        assert getattr(g, name) == getattr(group, name), name
    assert g.sampling_logprobs == group.sampling_logprobs and g.reward_extras == group.reward_extras
    assert (g.prefix_len, g.policy_version) == (1, 6)
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(g.routed_experts, group.routed_experts))
    try:
        PendingRound.from_state(state, {r.id: r for r in records[3:]})
    except ValueError as e:
        assert "'q0', which data.train no longer has" in str(e)
    else:
        raise AssertionError("a missing prompt was not named")


def test_a_rollout_one_update_behind_is_corrected_exactly_by_the_untruncated_product_only():
    """verify-unbiased --staleness 1's exact table: the rollout policy is pi_old before an exact
    gradient-ascent update (not noise). Against the on-policy gradient at pi_old, the untruncated
    sequence ratio is unbiased (to float64 rounding) and training on the stale samples as they are
    is biased by an amount far above rounding, as is token IS on 3-token completions."""
    from megatron_dppo.jobs.verify_rollout import RolloutCheckConfig, run_rollout_check, stale_kl

    cfg = RolloutCheckConfig(length=3, seed=0, staleness=1, cap=math.inf)
    assert 1e-4 < stale_kl(cfg) < 0.1  # a real update's distance, neither nothing nor noise-sized
    assert run_rollout_check(cfg, "seq_tis").unbiased
    assert run_rollout_check(cfg, "none").rel_bias > 0.05
    assert run_rollout_check(cfg, "tis").rel_bias > 0.05
    assert stale_kl(RolloutCheckConfig(length=3, seed=0, staleness=0)) != stale_kl(cfg)


def test_the_overlap_simulation_reads_the_bench_and_applies_the_plans_formula():
    """tools/simulate_rollout_ranks.py: rates from a bench's phase times (colocated on 2 GPUs, the
    dedicated engine and trainer on 1 each), then plan_step's model at a shape, checked by hand:
    colocated step = G/g + T/t + sync per GPU-batch; staleness 1 = max(rollout, train) + move."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("simulate_rollout_ranks", "tools/simulate_rollout_ranks.py")
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    zero = {"reward": 0.0, "rollout_wait": 0.0, "engine_idle": 0.0}
    colocated = {"rollout": 2.0, "logprob": 0.5, "train": 0.5, "sync": 0.1, **zero}
    dedicated = {"rollout": 1.0, "logprob": 0.25, "train": 0.25, "sync": 0.2, **zero}
    tokens = {"generated_tokens": 4000.0, "trained_tokens": 1000.0}
    bench = {
        "results": [
            {"run": "colocated", "phases_s": colocated, **tokens},
            {"run": "staleness0", "phases_s": dedicated, **tokens},
        ]
    }
    inp, moved = sim.inputs_from_bench(bench)
    assert (inp.gen_tokens_per_s, inp.dedicated_gen_tokens_per_s) == (1000.0, 4000.0)
    assert (inp.train_tokens_per_s, inp.dedicated_train_tokens_per_s) == (500.0, 2000.0)
    st = sim.simulate(inp, moved, gpus=8, rollout_gpus=6)
    # per GPU-batch: 2000 generated and 500 trained tokens; 8 GPUs -> 16000 and 4000 in the step
    assert math.isclose(st["rows"]["colocated"]["step_s"], 2.0 + 1.0 + 0.1)
    rollout_s, train_s = 16000 / (4000 * 6), 4000 / (2000 * 2)
    assert math.isclose(st["rows"]["staleness 1"]["step_s"], max(rollout_s, train_s) + 0.2)
    assert math.isclose(st["rows"]["staleness 0"]["step_s"], rollout_s + train_s + 0.2)


def test_a_later_wave_from_newer_weights_counts_at_its_own_lag():
    """BPPO's waves at trainer.max_staleness=1: a group's first wave sampled by version 3, its second
    by version 4 (the weights arrived in between). Trained from version 4, the first wave is 1
    update behind and the second 0: the lags are per completion, not the first wave's for all
    (the group used to report [1, 1, 1, 1]); the versions survive the checkpoint state."""
    from megatron_dppo.algorithms.records import policy_lags

    rec = _Prompt(0)
    first = Group(rec, 0, 0, [5], [[1], [2]], [1.0, 0.0], policy_version=3)
    second = Group(rec, 0, 0, [5], [[3], [4]], [0.0, 1.0], policy_version=4)
    first.extend(second)
    assert first.versions() == [3, 3, 4, 4]
    assert policy_lags([first], 4) == [1, 1, 0, 0]
    same = Group(rec, 0, 0, [5], [[1]], [1.0], policy_version=4)
    same.extend(Group(rec, 0, 0, [5], [[2]], [0.0], policy_version=4))
    assert same.completion_versions == [] and policy_lags([same], 5) == [1, 1]  # one version: nothing stored
    back = Group.from_state(json.loads(json.dumps(first.to_state())), rec)
    assert back.versions() == [3, 3, 4, 4]


def test_the_lag_histogram_and_a_lag_past_the_bound_is_an_error():
    """Trainer._check_staleness at step 5 (trained weights: version 4): completions sampled by
    versions 2, 2 and 3 lag 2, 2 and 1: at trainer.max_staleness=2 the histogram is
    rollout/policy_lag_frac_0..2 = 0, 1/3, 2/3; at trainer.max_staleness=1 the same groups are an
    error naming the key (a rollout rank more than k behind never trains silently)."""
    import pytest

    from megatron_dppo.train.trainer import Trainer

    rec = _Prompt(0)
    groups = [Group(rec, 0, 0, [5], [[1], [2]], [1.0, 0.0], policy_version=2)]
    groups.append(Group(rec, 0, 1, [5], [[3]], [1.0], policy_version=3))

    def trainer(k):
        cfg = Config()
        cfg.trainer.max_staleness = k
        return SimpleNamespace(roles=object(), cfg=cfg)

    m = Trainer._check_staleness(trainer(2), groups, 5)
    assert m["rollout/policy_lag_max"] == 2 and math.isclose(m["rollout/policy_lag_mean"], 5 / 3)
    fracs = [m[f"rollout/policy_lag_frac_{j}"] for j in range(3)]
    assert fracs == [0.0, 1 / 3, 2 / 3] and "rollout/policy_lag_frac_3" not in m
    with pytest.raises(RuntimeError, match=r"sampled 2 updates behind, more than trainer.max_staleness=1"):
        Trainer._check_staleness(trainer(1), groups, 5)
