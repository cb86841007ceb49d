"""The bridge's check plus the rollout engine's: HF vs Megatron logits, then engine vs actor log-probs.

    torchrun --nproc_per_node=W -m rlstack.verify --hf DIR|default|tiny --tp N --pp M \\
        [--engine hf|vllm --rollout-tp K] [--tol 1e-4]

`python -m megatron_bridge.verify` compares transformers' logits with the Megatron model's at TP x PP;
this adds, with `--engine`, a weight sync into that rollout engine (the Megatron weights perturbed
first, so only a working sync agrees) and `max_abs_logprob_diff` on the engine's own responses.
Rollout engines belong to rlstack, which the bridge never imports: so the combined tool lives here.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from megatron_bridge.verify import build_parser
    from megatron_bridge.verify import main as verify_main
    from rlstack.rollout.verify_sync import add_engine_args, engine_check

    parser = build_parser(prog="python -m rlstack.verify")
    add_engine_args(parser)

    def engine(opts, *args):
        return engine_check(opts, *args) if opts.engine is not None else {}

    return verify_main(argv, parser=parser, extra_checks=(engine,))


if __name__ == "__main__":  # vLLM and dist checkpointing spawn processes: keep the guard
    sys.exit(main())
