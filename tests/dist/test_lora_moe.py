"""LoRA on a Qwen3 MoE's experts (model.lora.experts=true, megatron/lora.py) against an independent
reference: tests/dist/workers/step/lora_moe_check.py loads random adapters on every module, each
expert's gate/up/down included, into the Megatron policy and into transformers' model (adapters
applied by hand, each expert's explicitly); the log-probs and the DPPO loss's gradient with respect
to every adapter must equal the reference's, at EP=1 and at EP=2 (each rank holds half the experts'
adapters), while the experts' adapters loaded one expert over must not (the check can fail).
"""

from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "workers" / "step" / "lora_moe_check.py"


@pytest.mark.parametrize("nproc,ep", [(1, 1), (2, 2)], ids=["ep1", "ep2-dp2"])
def test_expert_adapters_equal_reference_log_probs_and_gradients(launch, nproc, ep):
    res = launch(WORKER, nproc, "--ep", str(ep))
    out = res.stdout + res.stderr
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "LORA MOE CHECK PASSED" in res.stdout and f"ep={ep} dp={nproc}:" in res.stdout, out[-3000:]
