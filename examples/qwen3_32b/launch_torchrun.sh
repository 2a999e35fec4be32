#!/usr/bin/env bash
# Qwen3-32B DPPO on several nodes with plain torchrun. Run this script once on EVERY node,
# with the same environment except NODE_RANK:
#
#   MASTER_ADDR   hostname/IP of node 0 (reachable from all nodes)         required
#   MASTER_PORT   a free TCP port on node 0 (the rendezvous)                default 29500
#   NNODES        number of nodes                                           default 4
#   NODE_RANK     0 .. NNODES-1; node 0 hosts the rendezvous                required
#   GPUS_PER_NODE GPUs (processes) per node                                 default 8
#   RDZV_ID       rendezvous id, the same on every node, new per job        default qwen3-32b-dppo-$MASTER_PORT
#   HF_DIR        the Qwen3-32B HF checkpoint (config.json, tokenizer, safetensors)  required
#   TRAIN_DATA    prompts, JSONL or Parquet                                 required
#   CONFIG        run config                                   default examples/qwen3_32b/config.yaml
#   PYTHON        the environment's python                                  default python
#   SKIP_PLAN     1: do not run the `plan` pre-check                        default 0
#   DRY_RUN       1: print this node's torchrun command, run nothing        default 0
#
#   e.g. on node 1 of 4:
#   MASTER_ADDR=gpu-node-0 NNODES=4 NODE_RANK=1 HF_DIR=/models/Qwen3-32B TRAIN_DATA=/data/math.jsonl \
#       bash examples/qwen3_32b/launch_torchrun.sh trainer.max_steps=200
#
# Any arguments are dotted config overrides, passed to both `plan` and `train`.
# Nothing here needs a GPU tool (no nvidia-smi): tests/e2e/test_launch.py runs this script as two
# CPU "nodes" on 127.0.0.1 with the tiny model.
set -euo pipefail

: "${MASTER_ADDR:?set MASTER_ADDR to the hostname or IP of node 0}"
: "${NODE_RANK:?set NODE_RANK (0 .. NNODES-1)}"
: "${HF_DIR:?set HF_DIR to the Qwen3-32B checkpoint directory}"
: "${TRAIN_DATA:?set TRAIN_DATA to the prompt file}"
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_ID=${RDZV_ID:-qwen3-32b-dppo-$MASTER_PORT}
CONFIG=${CONFIG:-examples/qwen3_32b/config.yaml}
PYTHON=${PYTHON:-python}
SKIP_PLAN=${SKIP_PLAN:-0}
DRY_RUN=${DRY_RUN:-0}

if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || (( NODE_RANK >= NNODES )); then
    echo "launch_torchrun.sh: NODE_RANK=$NODE_RANK must be an integer in 0 .. NNODES-1 = $((NNODES - 1))" >&2
    exit 2
fi

cd "$(dirname "$0")/../.."   # the repository root: config paths are relative to it

RUN_ENV=(
    # Variable-length packs fragment the CUDA caching allocator; expandable segments keep that small.
    PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
    # Megatron's TP/SP communication overlap relies on one hardware queue per device.
    CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    # The colocated vLLM engine lives inside each training process (external_launcher).
    VLLM_ENABLE_V1_MULTIPROCESSING=0
)
export "${RUN_ENV[@]}"

OVERRIDES=(model.hf_dir="$HF_DIR" data.train="$TRAIN_DATA"
           parallel.nodes="$NNODES" parallel.gpus_per_node="$GPUS_PER_NODE" "$@")

# Refuse a layout that cannot fit before any GPU time is spent (exit 1: does not fit, 2: bad layout).
if [[ "$SKIP_PLAN" != 1 && "$DRY_RUN" != 1 ]]; then
    "$PYTHON" -m megatron_dppo.jobs.plan --config "$CONFIG" "${OVERRIDES[@]}"
fi

# c10d rendezvous: node 0 hosts it (is_host is explicit, so two "nodes" on one host, or a
# MASTER_ADDR that is an alias, cannot both try to). The rendezvous, not NODE_RANK, orders
# the nodes; the ranks of one node stay contiguous, so TP groups never leave a node.
IS_HOST=$(( NODE_RANK == 0 ? 1 : 0 ))
CMD=("$PYTHON" -m torch.distributed.run
     --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE"
     --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID"
     --rdzv_conf "is_host=$IS_HOST"
     -m megatron_dppo.cli train --config "$CONFIG" "${OVERRIDES[@]}")
if [[ "$DRY_RUN" == 1 ]]; then
    # One line per node, shell-quoted, runnable as printed (from the repository root).
    printf 'node %s:' "$NODE_RANK"; printf ' %q' env "${RUN_ENV[@]}" "${CMD[@]}"; printf '\n'
    exit 0
fi
exec "${CMD[@]}"
