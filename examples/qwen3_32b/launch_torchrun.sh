#!/usr/bin/env bash
# Qwen3-32B DPPO on several nodes with plain torchrun. Run this script once on EVERY node,
# with the same environment except NODE_RANK:
#
#   MASTER_ADDR   hostname/IP of node 0 (reachable from all nodes)         required
#   MASTER_PORT   a free TCP port on node 0                                 default 29500
#   NNODES        number of nodes                                           default 4
#   NODE_RANK     0 .. NNODES-1, this node's index                          required
#   GPUS_PER_NODE GPUs (processes) per node                                 default 8
#   HF_DIR        the Qwen3-32B HF checkpoint (config.json, tokenizer, safetensors)  required
#   TRAIN_DATA    prompts, JSONL or Parquet                                 required
#   CONFIG        run config                                   default examples/qwen3_32b/config.yaml
#   PYTHON        the environment's python                                  default python
#
#   e.g. on node 1 of 4:
#   MASTER_ADDR=gpu-node-0 NNODES=4 NODE_RANK=1 HF_DIR=/models/Qwen3-32B TRAIN_DATA=/data/math.jsonl \
#       bash examples/qwen3_32b/launch_torchrun.sh trainer.max_steps=200
#
# Any arguments are dotted config overrides, passed to both `plan` and `train`.
set -euo pipefail

: "${MASTER_ADDR:?set MASTER_ADDR to the hostname or IP of node 0}"
: "${NODE_RANK:?set NODE_RANK (0 .. NNODES-1)}"
: "${HF_DIR:?set HF_DIR to the Qwen3-32B checkpoint directory}"
: "${TRAIN_DATA:?set TRAIN_DATA to the prompt file}"
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CONFIG=${CONFIG:-examples/qwen3_32b/config.yaml}
PYTHON=${PYTHON:-python}

cd "$(dirname "$0")/../.."   # the repository root: config paths are relative to it

# Variable-length packs fragment the CUDA caching allocator; expandable segments keep that small.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# Megatron's TP/SP communication overlap relies on one hardware queue per device.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# The colocated vLLM engine lives inside each training process (external_launcher).
export VLLM_ENABLE_V1_MULTIPROCESSING=0

OVERRIDES=(model.hf_dir="$HF_DIR" data.train="$TRAIN_DATA"
           parallel.nodes="$NNODES" parallel.gpus_per_node="$GPUS_PER_NODE" "$@")

# Refuse a layout that cannot fit before any GPU time is spent (exit 1: does not fit, 2: bad layout).
"$PYTHON" -m megatron_dppo.plan --config "$CONFIG" "${OVERRIDES[@]}"

exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    -m megatron_dppo.cli train --config "$CONFIG" "${OVERRIDES[@]}"
