"""The plan `python -m rlstack.train --validate-only` prints when the model's config.json is present."""

from __future__ import annotations

import os
from typing import Optional

from rlstack.planner.build import Plan, plan_for_config
from rlstack.planner.shapes import model_config_present


def local_device_memory_gib(local_world_size: int = 1) -> tuple[str, float]:
    """(device, GiB per rank) of this machine: GPU 0's memory, else host memory split over local ranks."""
    import torch

    if torch.cuda.is_available():
        return "gpu", torch.cuda.get_device_properties(0).total_memory / 1024**3
    import psutil

    return "cpu", psutil.virtual_memory().total / 1024**3 / max(1, local_world_size)


def plan_for_validate(
    cfg,
    world_size: int,
    gpu_memory_gib: Optional[float] = None,
    config_path: str = "",
    model_config_file: Optional[str] = None,
) -> Optional[Plan]:
    """The plan for the device the config targets: `gpu_memory_gib` GPUs (--gpu-memory-gib), else the
    config's own parallel.gpu_memory_gib, else this machine. None when the model's config.json is
    neither at model.path nor given as `model_config_file`."""
    if not model_config_file and not model_config_present(cfg.model):
        return None
    target = gpu_memory_gib or cfg.parallel.gpu_memory_gib
    if target:
        device, memory = "gpu", target
    else:
        device, memory = local_device_memory_gib(int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))))
    return plan_for_config(
        cfg, world_size, memory, device=device, config_path=config_path, model_config_file=model_config_file
    )
