"""Worker: the weight sync's peak memory on CPU against the plan's formula (plan.sync_peak_bytes).

    torchrun --nproc_per_node 2 sync_peak_check.py --layout pp2|ep2|tp2

The tiny Qwen3 MoE (tests/tiny_models.py: 8 experts of width 48, layer 1 dense) at the layout,
its weights streamed as the trainer streams them into vLLM: MegatronPolicy.hf_weight_buckets
through the engine's stream_named_tensors, each tensor let go once consumed (vLLM copies it
into its own parameters). The peak of the bytes torch's CPU allocator holds above what it held
before (torch.profiler's memory events: every allocation and free, collectives' buffers
included; each collective returns once gloo has let go of its tensors, see
CollectivesLetGoOnReturn) must not exceed the plan's trainer-side formula, at a bucket of one
byte (one unit a bucket) and at one of about two units, and is the same when measured twice.
At PP=2 and EP=2 every rank builds whole units it does not hold (the other stage's, the other
EP rank's experts), so the peak must also be most of the formula (it is not vacuous). The
stream is checked to be the model's weights, bit for bit. Each
rank prints PEAK <json>; rank 0 prints SYNC PEAK CHECK PASSED.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from tiny_models import hf_checkpoint_tensors, tiny_qwen3_moe_model  # noqa: E402

from megatron_dppo.config import AlgorithmConfig, OptimConfig  # noqa: E402
from megatron_dppo.jobs.plan import sync_peak_bytes  # noqa: E402
from megatron_dppo.megatron import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402
from megatron_dppo.model.arch import Arch  # noqa: E402
from megatron_dppo.rollout.vllm_engine import stream_named_tensors  # noqa: E402

LAYOUTS = {"pp2": dict(tp=1, pp=2, ep=1), "ep2": dict(tp=1, pp=1, ep=2), "tp2": dict(tp=2, pp=1, ep=1)}


GLOO_RELEASE_TIMEOUT_S = 30.0


def _references(tensors: list) -> list:
    """Each tensor's references: to it, and to its storage (a view gloo takes holds only that)."""
    return [(t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)) for t in tensors]


class CollectivesLetGoOnReturn(TorchFunctionMode):
    """Every torch.distributed collective returns only once gloo has let go of its tensors.

    gloo runs a collective on one of its worker threads, whose Work holds the input and views of
    the output until that thread's loop comes round after the collective completed
    (ProcessGroupGloo::runLoop resets workInProgress_ after execute()), often after the caller's
    wait() has returned. When the export's own `del` comes first, the last reference is gloo's and
    the free happens on gloo's thread outside the collective, where the profiler records nothing
    (gloo carries the caller's profiler state into its thread only while the collective runs): in
    the profile the tensor stays held to the end of the run. Which of the EP gather's stacked
    inputs (48 and 96 kB) went that way differed from run to run: peaks of 851968 to 1196032 B at
    the same bucket, against the plan's 1185280 B. Waiting here until gloo has let go makes every
    free the profiler sees the export's own, when the export lets go; nothing is allocated while
    it waits, and gloo's own buffer (the flat output it allocates on its thread inside the
    collective, which the profiler does record) is counted as before."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) != dist.distributed_c10d.__name__:
            return func(*args, **kwargs)
        tensors = [
            t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, list) else [a]) if torch.is_tensor(t)
        ]
        before = _references(tensors)
        out = func(*args, **kwargs)
        deadline = time.monotonic() + GLOO_RELEASE_TIMEOUT_S
        while any(now > then for now, then in zip(_references(tensors), before)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"gloo still holds the tensors of {func.__name__} {GLOO_RELEASE_TIMEOUT_S:.0f} s on")
            time.sleep(1e-4)
        return out


def allocator_peak(run) -> int:
    """The most bytes torch's CPU allocator held during run() above what it held before it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, CollectivesLetGoOnReturn():
        run()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def consume(policy, bucket_bytes: int) -> dict:
    stats = {"num_tensors": 0, "num_bytes": 0}
    for _name, _tensor in stream_named_tensors(policy.hf_weight_buckets(bucket_bytes), stats, tied_embeddings=True):
        pass  # vLLM copies it into its parameters and lets it go
    return stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    layout = LAYOUTS[ap.parse_args().layout]
    initialize_parallel(layout["tp"], layout["pp"], seed=0, ep=layout["ep"])
    cfg, model = tiny_qwen3_moe_model(0)
    hf = hf_checkpoint_tensors(model)
    policy = MegatronPolicy(cfg, OptimConfig(lr=1e-3), AlgorithmConfig())
    policy.load_hf_state_dict(hf)
    got = policy.hf_state_dict()
    assert got.keys() == hf.keys(), sorted(got.keys() ^ hf.keys())[:5]
    assert all(torch.equal(got[k], hf[k]) for k in hf), [k for k in hf if not torch.equal(got[k], hf[k])][:5]
    del got

    arch = Arch.from_hf(cfg.to_dict())
    moe_layer = (arch.layer_params(1, True) + arch.expert_params()) * 4
    rank = dist.get_rank()
    largest_collective = [128 * arch.hidden] + (
        [arch.experts * 2 * arch.moe_ffn * arch.hidden] if layout["ep"] > 1 else []
    )
    gloo_copy = max(largest_collective) * 4  # the padded embedding (Megatron pads 50 to 128 x TP)
    for bucket in (1, 2 * moe_layer):
        formula = sync_peak_bytes(arch, 4, tp=layout["tp"], ep=layout["ep"], etp=1, rollout_tp=1, bucket=bucket)
        # gloo (not NCCL) takes a flat copy of a collective's output inside the collective
        formula["trainer"] += gloo_copy
        consume(policy, bucket)  # warm-up: first-call allocations of the collectives
        peak, again = (allocator_peak(lambda bucket=bucket: consume(policy, bucket)) for _ in range(2))
        print("PEAK " + json.dumps({"rank": rank, **layout, "bucket": bucket, "peak": peak, **formula}), flush=True)
        assert peak == again, f"sync peak {peak} B, then {again} B (bucket {bucket}): the measurement is not repeatable"
        assert peak <= formula["trainer"], f"sync peak {peak} B > the plan's {formula['trainer']} B (bucket {bucket})"
        if layout["tp"] == 1:  # every rank builds whole units it does not hold
            assert peak >= 0.5 * formula["trainer"], f"sync peak {peak} B: the plan's {formula['trainer']} B is loose"
    dist.barrier()
    if rank == 0:
        print("SYNC PEAK CHECK PASSED", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
