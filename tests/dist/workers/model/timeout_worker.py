"""python tests/dist/workers/model/timeout_worker.py

parallel.timeout_minutes reaches every process group (issue 22.5): the timeout is read back from
each group's backend (gloo here; NCCL the same way on a GPU), where torch's default would be 30
minutes for gloo and 10 for NCCL. Two cases: initialize_parallel starts the world itself, and the
caller made the world first with torch's default. Megatron's expert data-parallel gloo group,
which megatron-core 0.16-0.19 create without its timeout, is checked by name."""

from datetime import timedelta

import megatron_dppo.megatron  # noqa: F401  (before megatron.core: imports it without TorchInductor on CPU)

# isort: split
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dppo.megatron import destroy_parallel, initialize_parallel
from megatron_dppo.megatron.parallel import _process_groups, group_timeouts


def check(minutes: float) -> int:
    want = {timedelta(minutes=minutes)}
    named = {
        "world": dist.group.WORLD,
        "tp": parallel_state.get_tensor_model_parallel_group(),
        "pp": parallel_state.get_pipeline_model_parallel_group(),
        "dp": parallel_state.get_data_parallel_group(),
        "dp gloo": parallel_state.get_data_parallel_group_gloo(),
        "expert dp gloo": parallel_state.get_expert_data_parallel_group_gloo(),
    }
    groups = _process_groups()
    for name, group in named.items():
        assert group in groups, name
    wrong = {str(g): group_timeouts(g) for g in groups if group_timeouts(g) != want}
    assert not wrong, f"groups without {minutes} min: {wrong}"
    return len(groups)


def main():
    initialize_parallel(1, 1, seed=0, timeout_minutes=7)
    n = check(7)
    destroy_parallel()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # torch's default
    assert group_timeouts(dist.group.WORLD) == {timedelta(minutes=30)}
    initialize_parallel(1, 1, seed=0, timeout_minutes=9.5)
    m = check(9.5)
    destroy_parallel()
    print(f"timeouts OK on {n} and {m} groups")


if __name__ == "__main__":
    main()
