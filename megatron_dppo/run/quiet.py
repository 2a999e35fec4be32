"""Keep the libraries' own chatter off the run's screen (logging.verbose=true brings it back).

A training run's screen is the user's: a start-up line, a progress bar, a summary. vLLM,
Megatron-Core, torch and wandb each print warnings that say nothing to the user of this
project (no Apex on CPU, libtcmalloc not preloaded, "RotaryEmbedding: Failed to load weights"
at every weight sync because its cos/sin cache is not a checkpoint weight, wandb's banner...).
They are silenced at their source: environment variables read when those libraries load, and
warning filters on their modules. Our own warnings and every error still print; so do the
libraries' ERROR-level logs.

`quiet_libraries` must run before torch / vLLM / wandb are imported (the CLI calls it right after
parsing the config), since some of these variables are read once, at import.
"""

from __future__ import annotations

import logging
import os
import warnings

# Library modules whose Python warnings never concern a user of this project.
_WARNING_MODULES = ("megatron", "vllm", "torch", "transformers", "wandb", "tensorboard", "triton")


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(f in record.getMessage() for f in self.fragments)


def quiet_libraries(verbose: bool = False) -> None:
    if verbose:
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10 warnings such as NUMA binding notes
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Inherited by worker processes too (reward workers, torchrun children).
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    for module in _WARNING_MODULES:
        warnings.filterwarnings("ignore", module=rf"{module}(\.|$)")
    # Megatron-Core logs through the stdlib: keep its warnings (none are needed on screen) out.
    # vLLM warns about Triton while it is still importing, before its own log config applies.
    for name in ("megatron", "vllm"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Should vLLM's level be lowered by the user's environment, this one is still not news.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        _DropMessages("Failed to load weights")
    )
