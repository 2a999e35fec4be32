"""Rollout generation: vLLM colocated with the trainer (see vllm_engine.py).

Importing this package does not import vLLM (it costs 5-10 s); constructing an engine does.
"""

from megatron_dppo.rollout.vllm_engine import Completion, RolloutEngine, hf_completion_logprobs, request_seed

__all__ = ["Completion", "RolloutEngine", "hf_completion_logprobs", "request_seed"]
