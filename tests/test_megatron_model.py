"""Megatron-Core model, attention, log-probs and parallel layouts, on CPU.

Each test launches a worker script under torchrun (tests/dist/*_worker.py): Megatron's parallel
state and the CPU shim are process-global, so they never run inside the pytest process.
"""

from pathlib import Path

import pytest

DIST = Path(__file__).parent / "dist"


def test_cpu_compat_model_matches_transformers_and_bf16(torchrun):
    out = torchrun(DIST / "single_worker.py", 1)
    assert "OK" in out


def test_tp2_equals_tp1_and_packed_attention(torchrun):
    """TP=2 = TP=1 (loss, log-probs, entropy, grads); CPU init is TP-invariant; packed THD
    log-probs and grads equal per-sequence runs at TP=1 and TP=2."""
    out = torchrun(DIST / "tp_worker.py", 2)
    assert out.count("packing: logp err") == 2 and "OK" in out


def test_pp2_equals_single_stage_packs_and_trains(torchrun):
    """PP=2 through the 1F1B schedule over gloo p2p: same loss/grads as one stage, packed
    log-probs/grads equal per-sequence runs, and a few Adam steps reduce the loss."""
    out = torchrun(DIST / "pp_worker.py", 2)
    assert "PP=2 training losses" in out and "OK" in out


@pytest.mark.parametrize(
    "layout, expected",
    [
        (dict(world_size=3, tp=2, pp=1), "world size 3 is not a multiple of tp*pp"),
        (dict(world_size=8, tp=8, pp=1), "num_attention_heads 4 is not divisible by tp=8"),
        (dict(world_size=4, tp=4, pp=1), "num_key_value_heads (query groups) 2 is not divisible"),
        (dict(world_size=6, tp=1, pp=3), "num_layers 4 is not divisible by pp=3"),
        (dict(world_size=2, tp=0, pp=1), "must be >= 1"),
    ],
)
def test_validate_layout_names_the_fix(layout, expected):
    from megatron_dppo.megatron.parallel import validate_layout

    with pytest.raises(ValueError) as err:
        validate_layout(**layout, num_attention_heads=4, num_query_groups=2, num_layers=4)
    assert expected in str(err.value)
    assert "choose" in str(err.value) or "change" in str(err.value) or "must" in str(err.value)


def test_validate_layout_returns_data_parallel_size():
    from megatron_dppo.megatron.parallel import validate_layout

    assert validate_layout(8, 2, 2, num_attention_heads=4, num_query_groups=2, num_layers=4) == 2
