"""Everything that touches Megatron-Core lives in this package (and only here).

cpu_compat  the CUDA-to-CPU shim (active only without CUDA)
parallel    torch.distributed + Megatron parallel state (the layout rules: config/layout.py)
model       Qwen3 GPTModel from a transformers config (TE spec or local spec)
attention   packed (THD) causal attention for the local spec
logprobs    vocab-parallel per-token log-probs and entropy
"""

from megatron_dppo.megatron.cpu_compat import enable_cpu_compat, import_megatron_core, suspend_cpu_compat

import_megatron_core()  # first: on CPU without TorchInductor (cpu_compat.import_megatron_core)

from megatron_dppo.megatron.logprobs import token_logprobs, token_logprobs_and_entropy  # noqa: E402
from megatron_dppo.megatron.model import build_gpt_model  # noqa: E402
from megatron_dppo.megatron.parallel import (  # noqa: E402
    data_parallel_rank_and_size,
    destroy_parallel,
    initialize_parallel,
)
from megatron_dppo.model.vocab import padded_vocab_size  # noqa: E402

__all__ = [
    "enable_cpu_compat",
    "suspend_cpu_compat",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "build_gpt_model",
    "padded_vocab_size",
    "data_parallel_rank_and_size",
    "destroy_parallel",
    "initialize_parallel",
]
