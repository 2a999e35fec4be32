"""Qwen3 mixture-of-experts, in process: the HF <-> Megatron expert mapping (no Megatron) and the
sequence-parallel padding masks of later pipeline stages. The model against transformers and the
conversion at EP=2 and TP=2, under torchrun: tests/dist/test_moe_dist.py."""

from pathlib import Path

import pytest
import torch
from tiny_models import hf_checkpoint_tensors, tiny_qwen3_moe_model

from megatron_dppo.model import qwen3

REPO = Path(__file__).resolve().parents[2]


# ---- the in-memory mapping ----------------------------------------------------------------------
def _layout(cfg, **kw):
    return qwen3.layout_from_hf_config(cfg, padded_vocab=128, **kw)


def test_layout_follows_transformers_sparse_layers():
    cfg, model = tiny_qwen3_moe_model(0)
    layout = _layout(cfg)
    assert layout.moe_layers == (True, False, True, True) and layout.num_experts == 8 and layout.moe_intermediate == 48
    built = tuple(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers)
    assert built == layout.moe_layers  # transformers' own rule, decoder_sparse_step / mlp_only_layers
    cfg2, model2 = tiny_qwen3_moe_model(0, decoder_sparse_step=2, mlp_only_layers=[3])
    assert _layout(cfg2).moe_layers == (False, True, False, False)
    assert tuple(type(x.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for x in model2.model.layers) == (
        False,
        True,
        False,
        False,
    )


@pytest.mark.parametrize("te_names", [False, True])
def test_moe_hf_megatron_hf_is_bitwise(te_names):
    cfg, model = tiny_qwen3_moe_model(0)
    sd = hf_checkpoint_tensors(model)
    layout = _layout(cfg, te_names=te_names)
    mg = qwen3.hf_to_megatron(sd, layout)
    e3 = qwen3.expert_name(layout, 2, 3, "linear_fc1")
    assert e3 == (
        "decoder.layers.2.mlp.experts.linear_fc1.weight3"
        if te_names
        else "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
    )
    gate, up = sd["model.layers.2.mlp.experts.3.gate_proj.weight"], sd["model.layers.2.mlp.experts.3.up_proj.weight"]
    assert torch.equal(mg[e3], torch.cat([gate, up]))
    assert torch.equal(mg["decoder.layers.0.mlp.router.weight"], sd["model.layers.0.mlp.gate.weight"])
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in mg  # an MoE layer's norm, on both specs
    assert ("decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in mg) == te_names  # the dense layer's
    back = qwen3.megatron_to_hf(mg, layout)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    assert set(qwen3.hf_tensor_names(layout)) == set(sd)


def test_expert_parallel_shards_then_merge_recover_full():
    """EP 2 x expert-TP 2 (and TP 2 for the dense part): rank (t, e) holds experts [4e, 4e+4) under
    local numbers 0..3, each split over expert-TP; merging them back gives the full state dict."""
    cfg, model = tiny_qwen3_moe_model(0)
    layout = _layout(cfg)
    full = qwen3.hf_to_megatron(hf_checkpoint_tensors(model), layout)
    kw = dict(pp_rank=0, pp_size=1, ep_size=2, etp_size=2)
    shards = {
        (t, e): qwen3.shard_for_rank(full, layout, t, 2, ep_rank=e, etp_rank=t, **kw) for t in (0, 1) for e in (0, 1)
    }
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in shards[(0, 1)]
    assert "decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight" not in shards[(0, 1)]
    local = shards[(1, 1)]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(local, full["decoder.layers.0.mlp.experts.local_experts.4.linear_fc2.weight"][:, 24:])
    rebuilt = {}
    for e in (0, 1):
        for name in shards[(0, e)]:
            g = qwen3.to_global_name(name, 0, 1, layout.num_layers, ep_rank=e, ep_size=2, num_experts=8)
            rebuilt[g] = qwen3.tp_merge(g, [shards[(t, e)][name] for t in (0, 1)])
    assert rebuilt.keys() == full.keys()
    for k in full:
        assert torch.equal(rebuilt[k], full[k]), k


class _Group:
    """What megatron-core's sequence-parallel split reads of a process group: its size and rank."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _megatron_first_stage_split(mask, tp_size, tp_rank):
    """GPTModel._preprocess's cut of the [b, s] mask on the first stage under sequence parallelism:
    scatter_to_sequence_parallel_region's forward (split along the first dim) of its transpose."""
    from megatron.core.tensor_parallel.mappings import _split_along_first_dim

    return _split_along_first_dim(mask.transpose(0, 1).contiguous(), _Group(tp_size, tp_rank)).transpose(0, 1)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_later_stages_get_the_padding_mask_of_their_sequence_parallel_tokens(tp_size, sequence_parallel):
    """Every stage's routers see the mask entries of the tokens they route: the first stage's
    GPTModel cuts the whole mask itself, later stages need it cut as that cut does."""
    from megatron_dppo.megatron.router_stats import stage_padding_mask

    mask = torch.rand(1, 24, generator=torch.Generator().manual_seed(0)) < 0.3
    for tp_rank in range(tp_size):
        layout = dict(sequence_parallel=sequence_parallel, tp_rank=tp_rank, tp_size=tp_size)
        # the first stage: GPTModel cuts it, so it is passed whole
        assert torch.equal(stage_padding_mask(mask, first_stage=True, **layout), mask)
        later = stage_padding_mask(mask, first_stage=False, **layout)
        # the tokens a later stage's rank holds: those the first stage's cut gave it
        want = _megatron_first_stage_split(mask, tp_size, tp_rank) if sequence_parallel else mask
        assert torch.equal(later, want), (tp_rank, later, want)
        assert later.shape[1] == (24 // tp_size if sequence_parallel else 24)


def test_policy_passes_later_stages_their_sequence_parallel_mask(monkeypatch):
    """MegatronPolicy's forward step gives a stage >= 1 rank under SP its slice of the mask."""
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from megatron_dppo.megatron.policy import MegatronPolicy

    seq_index = torch.tensor([[0, 0, 0, 1, 1, -1, -1, -1]])  # two sequences, then padding
    batch = SimpleNamespace(seq_index=seq_index)
    policy = SimpleNamespace(sequence_parallel=True, tp_size=2)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 1)
    for first, want in ((True, seq_index < 0), (False, seq_index[:, 4:] < 0)):
        monkeypatch.setattr(parallel_state, "is_pipeline_first_stage", lambda *a, first=first, **k: first)
        assert torch.equal(MegatronPolicy._padding_mask(policy, batch), want)


def test_uneven_sequence_parallel_mask_is_a_named_error():
    from megatron_dppo.megatron.router_stats import stage_padding_mask

    with pytest.raises(ValueError, match="10 positions does not split over 4 sequence-parallel ranks"):
        stage_padding_mask(
            torch.zeros(1, 10, dtype=torch.bool), first_stage=False, sequence_parallel=True, tp_rank=0, tp_size=4
        )
