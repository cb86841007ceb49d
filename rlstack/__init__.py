"""rlstack: a Megatron-Core PPO/GRPO stack for LLM post-training.

Importing the package is light on purpose: it pulls in neither torch nor megatron-core;
submodules import them when they are used.
"""

__version__ = "0.1.0"
