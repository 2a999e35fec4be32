"""Fit what a model asks a dist checkpoint for to what the checkpoint holds, before loading.

Why: the Transformer Engine model asks for `_extra_state` entries (TE modules' FP8 metadata,
saved as ShardedObjects) that a checkpoint written from the local spec never had. Megatron's
local linears write `_extra_state` too (empty), so linear_qkv / linear_proj / linear_fc1 /
linear_fc2 match; the gap is the norms: the TE spec's q/k layernorms and final layernorm are TE
RMSNorms, which carry extra state (transformer_engine.pytorch.ops BasicOperation), where the
local spec has plain torch norms with none. dist_checkpointing.load with its default strictness
(ASSUME_OK_UNEXPECTED) leaves the check to torch DCP, which fails on the first requested key
the checkpoint lacks (tests/dist/test_convert_tools.py shows both).

Extra state is not weights: without FP8 a TE module's is empty, and with FP8 a missing one only
means the scaling history starts fresh. So each requested `_extra_state` object the checkpoint
lacks becomes a LocalNonpersistentObject holding the module's current value: dist_checkpointing
passes it through untouched and the module's load_state_dict sets what it already had. Any
other requested key the checkpoint lacks (a tensor, a non-extra-state object) is an error that
names it, before anything is read.
"""

from __future__ import annotations

from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

from megatron_dppo.megatron.dcp_metadata import read_dcp_metadata

EXTRA_STATE = "_extra_state"


def checkpoint_keys(model_dir: str) -> set[str]:
    """The keys a torch_dist checkpoint holds: ShardedTensor keys and ShardedObject unique keys."""
    return set(read_dcp_metadata(model_dir).state_dict_metadata)


def _requested_key(item) -> str | None:
    if isinstance(item, ShardedObject):
        return item.unique_key  # objects are stored one entry per shard
    if isinstance(item, (ShardedTensor, ShardedTensorFactory)):
        return item.key
    return None  # common (non-sharded) state, or already non-persistent


def fit_to_checkpoint(sharded_state: dict, model_dir: str) -> dict:
    """sharded_state (as built for dist_checkpointing.load) with every `_extra_state` object
    that model_dir lacks made non-persistent (kept at its current value); raises ValueError
    naming model_dir and the keys when anything else requested is missing. Edits in place and
    returns sharded_state."""
    held = checkpoint_keys(model_dir)
    missing = []

    def visit(container):
        for k in container.keys() if isinstance(container, dict) else range(len(container)):
            item = container[k]
            if isinstance(item, (dict, list)):
                visit(item)
                continue
            key = _requested_key(item)
            if key is None or key in held:
                continue
            if isinstance(item, ShardedObject) and item.key.endswith(EXTRA_STATE):
                container[k] = LocalNonpersistentObject(item.data)
            else:
                missing.append(key)

    visit(sharded_state)
    if missing:
        shown = ", ".join(sorted(set(missing))[:4])
        raise ValueError(
            f"{model_dir} lacks {len(set(missing))} key(s) the model asks for: {shown}"
            f"{' ...' if len(set(missing)) > 4 else ''} (a checkpoint of another model config, "
            "or of other optimizer settings?)"
        )
    return sharded_state
