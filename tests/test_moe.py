"""Qwen3 mixture-of-experts: the model (megatron/moe.py) against transformers, the HF <->
Megatron expert mapping, and sharded loading of only a rank's experts. Multi-process checks run
under torchrun (tests/dist/moe_worker.py); the mapping needs no Megatron and runs here."""

from pathlib import Path

DIST = Path(__file__).parent / "dist"


def test_moe_model_matches_transformers_at_ep1_and_ep2(torchrun):
    """Packed THD log-probs and gradients equal transformers' Qwen3MoeForCausalLM (fp32, 1e-5)
    at EP=1 and EP=2 (alltoall over gloo), for two routing variants (moe_worker.py says how)."""
    out = torchrun(DIST / "moe_worker.py", 2)
    assert out.count("max |logp diff|") == 8 and "OK" in out
