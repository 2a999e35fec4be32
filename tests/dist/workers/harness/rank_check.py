"""A rank of a 2-process launch, for tests/dist/test_prefork.py: what torchrun gives a rank (its
environment, its script as __main__, a gloo world) and, with --fail-rank R, rank R failing while
the other waits in a collective."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=-1)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == args.fail_rank:
    raise RuntimeError(f"rank {rank} fails on purpose")
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS")
seen = {k: os.environ.get(k) for k in keys}
# One write for both lines: the two ranks share the output, and print's separate writes of a line
# and its newline interleave under PYTHONUNBUFFERED (as they did in CI).
sys.stdout.write(
    f"RANK_CHECK {sorted(seen.items())} sum={total.item()} threads={torch.get_num_threads()} main={__name__}\n"
    f"argv={sys.argv[1:]} path0={os.path.basename(sys.path[0])}\n"
)
sys.stdout.flush()
dist.destroy_process_group()
