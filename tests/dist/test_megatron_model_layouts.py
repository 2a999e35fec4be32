"""The Megatron-Core model on CPU against transformers, at TP=1, TP=2 and PP=2, with packed attention
(Qwen3; the Llama and Qwen2 families in families_worker.py).

Each test launches a worker script under torchrun (tests/dist/workers/model/*_worker.py): Megatron's
parallel state and the CPU shim are process-global, so they never run inside the pytest process.
The in-process tests of the packed-attention kernels and the layout rules: tests/unit/test_megatron_model.py."""

from pathlib import Path

DIST = Path(__file__).resolve().parents[1] / "dist" / "workers" / "model"


def test_cpu_compat_model_matches_transformers_and_bf16(torchrun):
    out = torchrun(DIST / "single_worker.py", 1)
    assert "OK" in out


def test_local_spec_final_norm_ignores_megatrons_block_default(torchrun):
    """Item 3 of issue 22: with Apex importing but TE not, Megatron's block-level final norm is
    Apex's FusedLayerNorm, which asserts on RMSNorm; the local spec sets its own."""
    out = torchrun(DIST / "final_norm_worker.py", 1)
    assert "final norm RMSNorm" in out and "OK" in out


def test_tp2_equals_tp1_and_packed_attention(torchrun):
    """TP=2 = TP=1 (loss, log-probs, entropy, grads); CPU init is TP-invariant; packed THD
    log-probs and grads equal per-sequence runs at TP=1 and TP=2."""
    out = torchrun(DIST / "tp_worker.py", 2)
    assert out.count("packing (pad_multiple") == 8 and "OK" in out  # 4 cases at TP=1 and at TP=2


def test_pp2_equals_single_stage_packs_and_trains(torchrun):
    """PP=2 through the 1F1B schedule over gloo p2p: same loss/grads as one stage, packed
    log-probs/grads equal per-sequence runs, and a few Adam steps reduce the loss."""
    out = torchrun(DIST / "pp_worker.py", 2)
    assert out.count("packing at PP=2, pad_multiple") == 4  # 2 cases x 2 ranks
    assert "PP=2 training losses" in out and "OK" in out


def test_llama_and_qwen2_equal_transformers_at_tp1_tp2_pp2(torchrun):
    """The Llama (tied with llama3 RoPE, untied) and Qwen2 (q/k/v biases; tied, untied) families:
    packed THD log-probs and gradients equal transformers' (fp32, 1e-5) at TP=1, TP=2 and PP=2,
    so each layout equals one process (families_worker.py says how)."""
    out = torchrun(DIST / "families_worker.py", 2)
    assert out.count("max |logp diff|") == 4 * 3 * 2 and "OK" in out  # variants x layouts x ranks
