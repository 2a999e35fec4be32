"""LoRA on Megatron-Core (megatron/lora.py) against HF PEFT, the independent reference.

Each case launches tests/dist/workers/step/lora_check.py: a tiny Qwen3 with PEFT adapters on all
seven modules (random A and B) and the same adapters in the Megatron policy; the log-probs and the
DPPO loss's gradient with respect to every adapter must equal PEFT's, B = 0 must be the base model,
the KL reference (adapters off) the base model, and a step must move the adapters only.
"""

from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[1] / "dist" / "workers" / "step" / "lora_check.py"


@pytest.mark.parametrize(
    "family,tp,pp",
    [("qwen3", 2, 1), ("qwen3", 1, 2), ("llama", 2, 1), ("qwen2", 1, 2)],
    ids=["qwen3-tp2", "qwen3-pp2", "llama-tp2", "qwen2-pp2"],
)
def test_lora_equals_peft_log_probs_and_adapter_gradients(launch, family, tp, pp):
    """Every family model.hf_dir takes: Qwen3 (q/k norms), Llama 3 (none), Qwen2.5 (q/k/v biases)."""
    res = launch(WORKER, 2, "--tp", str(tp), "--pp", str(pp), "--family", family)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "LORA CHECK PASSED" in res.stdout
    assert f"{family} tp={tp} pp={pp} dp=1:" in res.stdout


@pytest.mark.parametrize(
    "control,nproc,layout,needle",
    [
        ("alpha", 2, (), "log-probs differ from PEFT's"),  # DP=2: alpha twice PEFT's
        ("tp-sum", 2, ("--tp", "2"), "relative adapter grad error"),  # A's gradient not summed over TP
    ],
)
def test_lora_check_fails_on_a_wrong_adapter(launch, control, nproc, layout, needle):
    """Negative controls: the same check on a deliberately wrong LoRA must fail."""
    res = launch(WORKER, nproc, *layout, "--negative-control", control)
    assert res.returncode != 0
    assert needle in res.stdout + res.stderr
