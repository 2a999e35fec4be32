"""vLLM serves the Llama and Qwen2 families as the trainer builds them: after the trainer's weight
sync (MegatronPolicy.hf_state_dict -> RolloutEngine.load_weights: Qwen2's q/k/v biases, Llama's
tied embedding under HF names), vLLM's log-probs of its sampled sequences equal the Megatron
policy's (fp32, CPU), and before the sync they do not. The worker: tests/dist/workers/train/
sync_check.py (one engine start per family, in a subprocess: Megatron's CPU shim is process-wide)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "dist" / "workers" / "train" / "sync_check.py"


@pytest.mark.slow  # ~70 s each on 2 busy cores: an engine start and a Megatron policy
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_vllm_logprobs_equal_megatron_after_weight_sync(family_hf_models, family):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, str(WORKER), str(family_hf_models[family])],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    result = json.loads(res.stdout.split("RESULT ")[1].splitlines()[0])
    assert result["initial"] < 1e-4, result
    assert result["before_sync"] > 1e-2, result  # the check can fail: stale engine weights are seen
    assert result["after_sync"] < 1e-4, result
