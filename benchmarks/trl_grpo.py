"""TRL's GRPOTrainer on the same model, task, batch and lengths as an rlstack config (the comparison run).

Runs in the benchmark's own environment (`.venv-bench`: TRL, its transformers, the same torch), never
in `.venv`. It imports only pure-Python parts of rlstack (synthetic rows, reward rules), so the
prompts and the reward are the ones rlstack trains on. Timing: wall clock between consecutive
optimizer steps (a step = one generation of prompts x num_generations, the reference forward and
the policy forward+backward over gradient_accumulation_steps micro-batches, the optimizer step).

    .venv-bench/bin/python benchmarks/trl_grpo.py --hf-dir DIR --steps 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF checkpoint directory (rlstack's provisioned model)")
    p.add_argument("--task", default="arith", help="rlstack synthetic task (rlstack.data.synthetic)")
    p.add_argument("--train-size", type=int, default=2048)
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward/backward")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=0.001, help="KL coefficient (> 0 loads a reference model)")
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--output-dir", default="outputs/bench_trl")
    p.add_argument("--json", required=True, help="where to write the result")
    return p.parse_args(argv)


def make_dataset(args):
    from datasets import Dataset

    from rlstack.data.synthetic import make_rows

    rows = make_rows(args.task, args.train_size, args.data_seed, "train", args.max_operand)
    return Dataset.from_list(
        [
            {
                "prompt": r["prompt"],
                "ground_truth": str(r["reward_model"]["ground_truth"]),
                "data_source": r["data_source"],
            }
            for r in rows
        ]
    )


def reward_fn(completions, ground_truth, data_source, **kwargs) -> list[float]:
    """rlstack's rule scorer for each completion (conversational: a list with one assistant message)."""
    from rlstack.rewards import RewardScorer

    scorer = RewardScorer()
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [scorer.score(src, text, gt) for text, gt, src in zip(texts, ground_truth, data_source)]


def make_callback(records: list):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall clock of each optimizer step: from the previous step's end (or train start) to this one's."""

        def on_train_begin(self, args, state, control, **kw):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            records.append({"step": state.global_step, "step_s": now - self.last, "rss_peak_gib": _peak_rss_gib()})
            self.last = now

        def on_log(self, args, state, control, logs=None, **kw):
            if records and logs:
                records[-1].update({f"trl/{k}": v for k, v in logs.items() if isinstance(v, (int, float))})

    return StepTimer()


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1024**3


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer

    num_seqs = args.prompts * args.generations
    if num_seqs % args.micro_batch_size:
        raise ValueError(f"prompts x generations ({num_seqs}) must be a multiple of --micro-batch-size")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        beta=args.beta,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=num_seqs // args.micro_batch_size,  # one generation per optimizer step
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        bf16=args.dtype == "bfloat16",
        fp16=False,
        use_cpu=not torch.cuda.is_available(),  # transformers refuses bf16 without a GPU unless told it is the CPU
        gradient_checkpointing=args.gradient_checkpointing,  # TRL defaults to True; rlstack's config does not
        model_init_kwargs={"dtype": dtype},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.data_seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    records: list[dict] = []
    trainer = GRPOTrainer(
        model=args.hf_dir,
        reward_funcs=[reward_fn],
        args=config,
        train_dataset=make_dataset(args),
        callbacks=[make_callback(records)],
    )
    t0 = time.perf_counter()
    trainer.train()
    result = {
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "prompts": args.prompts,
        "generations": args.generations,
        "max_new_tokens": args.max_new_tokens,
        "micro_batch_size": args.micro_batch_size,
        "beta": args.beta,
        "gradient_checkpointing": args.gradient_checkpointing,
        "train_s": time.perf_counter() - t0,
        "steps": records,
        "peak_rss_gib": _peak_rss_gib(),
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
