"""The in-memory HF <-> Megatron mapping (no Megatron needed): round trips and sharding."""

import pytest
import torch
from tiny_models import shard_and_merge, tiny_qwen3_model

from megatron_dppo.model import qwen3
from megatron_dppo.model.vocab import padded_vocab_size


def _hf(tied, vocab=50, seed=0):
    cfg, model = tiny_qwen3_model(seed, perturb_norms=False, vocab_size=vocab, tie_word_embeddings=tied)
    sd = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    return cfg, sd


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("te_names", [False, True])
def test_hf_megatron_hf_is_bitwise(tied, te_names):
    cfg, sd = _hf(tied)
    layout = qwen3.layout_from_hf_config(cfg, padded_vocab=padded_vocab_size(50, 2, 128), te_names=te_names)
    assert layout.padded_vocab == 256
    mg = qwen3.hf_to_megatron(sd, layout)
    assert mg["embedding.word_embeddings.weight"].shape == (256, 64)
    back = qwen3.megatron_to_hf(mg, layout)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_fused_qkv_is_grouped_per_kv_head():
    cfg, sd = _hf(True)
    layout = qwen3.layout_from_hf_config(cfg)
    q, k, v = (sd[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    fused = qwen3.fuse_qkv(q, k, v, layout)
    d = 32
    # group 0: q heads 0,1 then k head 0 then v head 0; group 1 likewise
    expect = torch.cat([q[0 : 2 * d], k[0:d], v[0:d], q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]])
    assert torch.equal(fused, expect)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_shard_then_merge_recovers_full(tp, pp):
    cfg, sd = _hf(False)
    layout = qwen3.layout_from_hf_config(cfg, padded_vocab=padded_vocab_size(50, tp, 8))
    full = qwen3.hf_to_megatron(sd, layout)
    shards, rebuilt = shard_and_merge(full, layout, tp, pp)
    assert rebuilt.keys() == full.keys()
    for k in full:
        assert torch.equal(rebuilt[k], full[k]), k
    if tp == 2:  # fc1: each rank holds [gate_r; up_r]
        fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
        r1 = shards[(1, 0)]["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(r1[:48], fc1[48:96]) and torch.equal(r1[48:], fc1[144:])


def test_unsupported_architecture_and_missing_tensor_are_named():
    cfg, sd = _hf(True)
    cfg.architectures = ["MistralForCausalLM"]
    with pytest.raises(ValueError, match="architectures=\\['MistralForCausalLM'\\]: only \\('Qwen3ForCausalLM', "):
        qwen3.layout_from_hf_config(cfg)
    cfg.architectures = ["Qwen3ForCausalLM"]
    del sd["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.2.mlp.up_proj.weight"):
        qwen3.hf_to_megatron(sd, qwen3.layout_from_hf_config(cfg))
    with pytest.raises(ValueError, match="num_layers=4 is not divisible by pipeline parallel size 3"):
        qwen3.stage_layers(4, 0, 3)


def test_experts_split_over_expert_tp_everything_else_over_tp():
    """One rule for every place that shards or merges a megatron tensor (hf_load, shard_for_rank,
    the weight sync, the converter): an expert's group is expert-TP, a dense tensor's TP."""
    from megatron_dppo.model.qwen3 import is_expert, split_group

    experts = [
        "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight",  # local spec
        "decoder.layers.3.mlp.experts.linear_fc2.weight7",  # TE spec
    ]
    dense = ["decoder.layers.3.mlp.linear_fc1.weight", "decoder.layers.3.mlp.router.weight", "output_layer.weight"]
    for name in experts:
        assert is_expert(name) and split_group(name, 4, 2, tp_rank=3, etp_rank=1) == (1, 2)
    for name in dense:
        assert not is_expert(name) and split_group(name, 4, 2, tp_rank=3, etp_rank=1) == (3, 4)
