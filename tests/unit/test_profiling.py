"""The FLOP formula against an independent count, MFU / peak helpers, and the two profiling
tools end to end on the tiny CPU model (profile_throughput: 2 steps per method)."""

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_dppo.model.arch import Arch
from megatron_dppo.run import profiling

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "qwen3_configs"
# GQA (4 query heads, 2 KV groups), head_dim != hidden / heads, SwiGLU, tied head: what Qwen3 has.
TINY = dict(
    vocab_size=50,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    tie_word_embeddings=True,
    max_position_embeddings=128,
)


def _counted(length: int, backward: bool = False) -> dict:
    """FlopCounterMode on a transformers Qwen3 forward (+ backward) of one sequence.
    Eager attention, so QK^T and AV show up as aten.bmm (the CPU SDPA kernel is not counted);
    the counter charges the full L x L score matrix (it ignores the causal mask)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**TINY)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(input_ids=torch.randint(0, TINY["vocab_size"], (1, length))).logits
        if backward:
            logits.float().sum().backward()
    ops = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    return {
        "linear": ops.pop("aten.mm", 0) + ops.pop("aten.addmm", 0),
        "attention": ops.pop("aten.bmm", 0),
        "other": sum(ops.values()),
    }


@pytest.mark.parametrize("length", [7, 32])
def test_forward_flops_match_an_independent_count(length):
    mine = profiling.forward_flops_breakdown(TINY, [length])
    counted = _counted(length)
    assert counted["other"] == 0
    assert mine["linear"] == pytest.approx(counted["linear"], rel=0.02)
    # causal: token i sees i+1 keys, sum = L(L+1)/2, where the counter charges L^2
    assert mine["attention"] == pytest.approx(counted["attention"] * (length + 1) / (2 * length), rel=1e-9)
    assert mine["total"] == mine["linear"] + mine["attention"]


def test_training_is_three_forwards():
    fwd, both = _counted(16), _counted(16, backward=True)
    assert both["linear"] == pytest.approx(3 * fwd["linear"], rel=0.02)
    assert both["attention"] == pytest.approx(3 * fwd["attention"], rel=0.02)
    assert profiling.train_flops(TINY, [16, 5]) == 3 * profiling.forward_flops(TINY, [16, 5])


def test_attention_is_quadratic_per_packed_sequence():
    # The counter: attention of one sequence grows with L^2 (4x for twice the length).
    assert _counted(32)["attention"] == 4 * _counted(16)["attention"]
    # Packed sequences cost what they cost alone (no cross-sequence attention) ...
    alone = [profiling.forward_flops_breakdown(TINY, [n]) for n in (16, 16)]
    packed = profiling.forward_flops_breakdown(TINY, [16, 16])
    for k in ("linear", "attention"):
        assert packed[k] == sum(a[k] for a in alone)
    # ... and less than one sequence of the same total length: same linear, less attention.
    merged = profiling.forward_flops_breakdown(TINY, [32])
    assert merged["linear"] == packed["linear"]
    assert merged["attention"] == pytest.approx(packed["attention"] * 33 / 17)  # 32*33/2 vs 2 * 16*17/2


def test_matmul_params_is_the_model_without_norms():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**TINY))
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert profiling.matmul_params(TINY) == sum(p.numel() for p in model.parameters()) - norms
    # The real 0.6B / 1.7B shapes (no weights needed): within a hair of the published sizes.
    for size, billions in (("0.6B", 0.596), ("1.7B", 1.72)):
        cfg = json.loads((CONFIGS / size / "config.json").read_text())
        assert profiling.matmul_params(cfg) / 1e9 == pytest.approx(billions, rel=0.01)
        assert profiling.matmul_params(cfg) < Arch.from_hf(cfg).hf_params()


def test_generation_flops_share_the_prompt():
    one = profiling.generation_flops(TINY, 5, [3])
    assert one == pytest.approx(profiling.forward_flops(TINY, [8]))
    two = profiling.generation_flops(TINY, 5, [3, 3])
    assert two == pytest.approx(2 * profiling.forward_flops(TINY, [8]) - profiling.forward_flops(TINY, [5]))


def test_mfu_and_peaks():
    assert profiling.mfu(989e12, 2.0, 989e12) == 0.5
    assert profiling.mfu(1.0, 0.0, 1.0) == 0.0
    assert profiling.device_peak_flops("H100")[0] == 989e12
    assert profiling.device_peak_flops("h200")[0] == 989e12
    assert profiling.device_peak_flops("a100")[0] == 312e12
    assert profiling.device_peak_flops("cpu", override=5e10) == (5e10, "cpu: given on the command line")
    assert profiling.device_peak_flops("h100", override=5e14)[0] == 5e14
    peak, source = profiling.device_peak_flops("cpu")
    assert peak > 1e8 and "measured" in source


def test_summarize_phases():
    steps = [
        {"time/rollout": 1.0, "time/train": 2.0, "time/step": 3.5},
        {"time/rollout": 3.0, "time/train": 2.0, "time/sync": 0.5, "time/step": 6.5},
    ]
    s = profiling.summarize_phases(steps)
    assert s["rollout"] == 2.0 and s["train"] == 2.0 and s["sync"] == 0.25 and s["logprob"] == 0.0
    assert s["step"] == 5.0 and s["other"] == pytest.approx(0.75)
