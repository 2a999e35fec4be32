"""What several test files and workers need alike, defined once: SmolLM2-135M's shape (the real model
examples/smollm2 trains, for the tests that check it without loading it) and load_tool, which loads
a script (tools/*.py, a worker, an example's reward) as a module without running its main.

Torch-free and import-light: the worker scripts under tests/dist/workers/ import it too, after they
put this folder (tests/) on their sys.path.
"""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# SmolLM2-135M(-Instruct)'s sizes, as its model card's config.json has them and as
# tools/build_smollm2.py's dir has them (tests/e2e/test_smollm2_tool.py checks the built one).
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
SMOLLM2_135M_ROPE_THETA = 1e5  # default rope, no scaling
# Its config.json (the fields the trainer and transformers read), rope_theta at the top level as the
# model card has it.
SMOLLM2_135M_CONFIG_JSON = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    **SMOLLM2_135M,
    rope_theta=SMOLLM2_135M_ROPE_THETA,
    rms_norm_eps=1e-5,
    hidden_act="silu",
)


def load_tool(name_or_path, *, module_name: str | None = None):
    """The script as a fresh module, its `if __name__ == "__main__"` block not run.

    name_or_path: a bare name ("compare_methods") is tools/<name>.py; anything else is a path to
    the .py file (str or Path; relative to the working directory, as `python <path>` takes it).
    The module is registered in sys.modules as module_name (default: the file's stem), where
    dataclasses and pickle look a module's classes up; each call runs the file again."""
    path = Path(name_or_path)
    if path.suffix != ".py" and len(path.parts) == 1:
        path = REPO / "tools" / f"{path}.py"
    name = module_name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:  # as `import` does: a module that failed to run is not left registered
        del sys.modules[name]
        raise
    return module
