"""Qwen3 mixture-of-experts: the model (megatron/moe.py) against transformers, the HF <->
Megatron expert mapping, conversion at EP=2 and TP=2, and sharded loading of only a rank's
experts. Multi-process checks run under torchrun (tests/dist/moe_worker.py,
tests/dist_convert/moe_ckpt.py); the in-memory mapping needs no Megatron and runs here."""

import json
from pathlib import Path

import pytest
import torch
from test_convert_tools import _ok, _weights
from tiny_models import hf_checkpoint_tensors, tiny_qwen3_moe_model

from megatron_dppo.model import qwen3

REPO = Path(__file__).resolve().parents[1]
DIST = REPO / "tests" / "dist"
TO_MG = REPO / "tools" / "convert_hf_to_megatron.py"
TO_HF = REPO / "tools" / "convert_megatron_to_hf.py"
CKPT_WORKER = REPO / "tests" / "dist_convert" / "moe_ckpt.py"


def test_moe_model_matches_transformers_at_ep1_and_ep2(torchrun):
    """Packed THD log-probs and gradients equal transformers' Qwen3MoeForCausalLM (fp32, 1e-5)
    at EP=1 and EP=2 (alltoall over gloo), for two routing variants (moe_worker.py says how)."""
    out = torchrun(DIST / "moe_worker.py", 2)
    assert out.count("max |logp diff|") == 8 and "OK" in out


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


# ---- conversion tools and sharded loading at EP=2 and TP=2 --------------------------------------
@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "hf"
    _, model = tiny_qwen3_moe_model(5)
    model.save_pretrained(path, max_shard_size="200KB")  # several shards + index, per-expert names
    assert len(list(path.glob("*.safetensors"))) > 3
    return path


def _assert_same_weights(a: Path, b: Path):
    x, y = _weights(a), _weights(b)
    assert x.keys() == y.keys() and any(".mlp.experts.7.down_proj" in k for k in x)
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--ep", "--tp"])
def test_conversion_round_trip_is_bitwise_at_ep2_and_tp2(moe_hf, tmp_path, launch, flag):
    """HF -> Megatron (tools, at --ep 2 or --tp 2) -> the trainer's load_checkpoint in 2 torchrun
    workers at that layout (each rank's tensors bitwise equal to the HF files; the HF loader reads
    only the rank's experts; logits equal transformers' within 1e-5) -> the trainer's
    save_checkpoint at that layout -> HF: bitwise equal to the original. At --ep 2 the tool's own
    --verify launches the 2 processes."""
    mg, root, back = tmp_path / "mg", tmp_path / "run", tmp_path / "back"
    verify = ["--verify", "--tolerance", 1e-5] if flag == "--ep" else []
    out = _ok(launch(TO_MG, 1, "--hf-dir", moe_hf, "--out-dir", mg, flag, 2, *verify))
    assert json.loads((mg / "trainer_state.json").read_text())["source"][flag[2:]] == 2
    if verify:
        assert "(tp=1, pp=1, ep=2, cpu)" in out and "verify OK" in out
        diff = float(out.split("verify OK: max |logit difference| ")[1].split()[0])
        assert diff <= 1e-5
    out = _ok(launch(CKPT_WORKER, 2, "--ckpt", mg, "--hf-dir", moe_hf, "--root", root, flag, 2))
    results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 2
    for r in results:
        assert r["converted_vs_hf"] == [] and r["hf_load_vs_hf"] == [] and r["dense_unread"] == []
        assert r["experts_read"] == r["experts_owned"] and r["logit_diff"] <= 1e-5
        assert len(r["experts_owned"]) == (4 if flag == "--ep" else 8)
    _ok(launch(TO_HF, 1, "--megatron-dir", root, "--out-dir", back))  # root: found via `latest`
    _assert_same_weights(moe_hf, back)


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
