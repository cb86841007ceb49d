"""LoRA GRPO end to end on `yaml_configs/tiny_cpu.yaml` (2 ranks under torchrun, CPU), docs/lora.md.

1. The run learns: the reward rises with only the adapters trained.
2. Kill and resume: a run SIGKILLed during step 4 and restarted with `checkpoint.resume=auto` logs
   steps 4-6 with exactly the metrics of an uninterrupted run; its checkpoints hold the adapters and
   their Adam state only (the frozen base comes from HF at start), far smaller than a full one.
3. Export through the command line: `python -m rlstack.export` writes the PEFT adapter directory
   (peft loads it on the base HF model) and, with `--merge`, a merged HF model; both give the
   actor's logits (the checkpoint loaded into a LoRA actor) within 1e-5.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import run_distributed
from tests.e2e.runs import ROOT, kill_during_step_4, metrics_by_step, read_metrics, torchrun_train, train_steps

LORA = ["model.lora.rank=8", "model.lora.alpha=16"]
STEPS = "trainer.total_steps=6"
VOLATILE = ("timing/", "throughput/", "mem/", "sync/seconds")
pytestmark = pytest.mark.slow


def _train(out_dir: str, *overrides: str) -> str:
    proc = torchrun_train(out_dir, [*LORA, *overrides], timeout=300)
    return proc.stdout + proc.stderr


# The frozen tied head and final norm bound the tiny model's logits to about +-2.5 (embedding rows
# of norm 0.22 against a normed hidden of norm sqrt(128)): at temperature 1 the best policy LoRA can
# reach puts ~4% on the digit, so the learning run samples at temperature 0.25 (actor and engine alike).
LEARN = ["trainer.total_steps=20", "rollout.temperature=0.25", "algorithm.actor_lr=0.02", "checkpoint.save_every=0"]


def test_lora_grpo_learns(tmp_path):
    out = str(tmp_path / "learn")
    _train(out, *LEARN)
    rows = train_steps(read_metrics(out))
    rewards = [m["reward/mean"] for m in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    # measured: 0.022 over steps 1-5, 0.096 over steps 11-20
    print(f"LoRA GRPO reward: steps 1-5 {first:.3f}, steps 11-20 {last:.3f}")
    assert last > first + 0.04 and last > 2.5 * first, rewards
    assert all(r["sync/bytes"] == rows[-1]["sync/bytes"] for r in rows[1:]), (
        "every later sync moves the same bytes (adapters or merged adapted linears), never the base"
    )


def _actor_logits(hf_dir: str, ckpt: str, input_ids):
    """The LoRA actor as a resume builds it (base from HF, adapters from the checkpoint): its logits,
    and the base model's (adapters off)."""
    import torch

    from megatron_bridge.lora import adapters_disabled
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.verify import megatron_logits
    from rlstack.checkpoint import load_role
    from rlstack.config import LoraConfig
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings, lora_spec

    g = init_distributed(1, 1)
    spec = lora_spec(LoraConfig(rank=8, alpha=16.0), seed=0)
    role = MegatronRole(hf_dir, g, torch.float32, optim=OptimSettings(lr=0.0), lora=spec)
    load_role(role, os.path.join(ckpt, "actor"), with_optimizer=False)
    role.model.eval()
    with adapters_disabled(role.module):
        base = megatron_logits(role.module, input_ids, g, role.args.vocab_size)
    return megatron_logits(role.module, input_ids, g, role.args.vocab_size), base


def _export(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "rlstack.export", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_lora_killed_run_resumes_exactly_and_exports(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = str(tmp_path / "reference")
    _train(reference, STEPS, "checkpoint.save_every=0", "checkpoint.resume=never")
    expected = metrics_by_step(reference, VOLATILE)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    run = str(tmp_path / "run")
    kill_during_step_4(run, [*LORA, STEPS, "checkpoint.save_every=1"])
    root = os.path.join(run, "checkpoints")
    step3 = os.path.join(root, "step_00000003")
    output = _train(run, STEPS, "checkpoint.save_every=1", "checkpoint.resume=auto")
    assert f"resumed from {step3} at step 3" in output
    resumed = metrics_by_step(run, VOLATILE)
    for step in (1, 2, 3, 4, 5, 6):
        assert resumed[step] == expected[step], f"step {step} differs from the uninterrupted run"

    # the checkpoint holds the adapters (and their Adam state), not the base
    ckpt = os.path.join(root, "step_00000006")
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        record = json.load(f)["lora"]["actor"]
    assert record["rank"] == 8 and os.path.exists(os.path.join(record["base"], "config.json"))
    hf_dir = record["base"]
    saved = sum(os.path.getsize(os.path.join(ckpt, "actor", n)) for n in os.listdir(os.path.join(ckpt, "actor")))
    base_bytes = os.path.getsize(os.path.join(hf_dir, "model.safetensors"))
    print(f"LoRA actor checkpoint {saved} B, the base weights alone {base_bytes} B")
    assert saved < base_bytes / 2

    # export through the command line, compared with the actor the checkpoint resumes into
    peft_dir, merged_dir = str(tmp_path / "peft"), str(tmp_path / "merged")
    _export("--ckpt", root, "--out", peft_dir)
    _export("--ckpt", root, "--out", merged_dir, "--merge")
    assert sorted(os.listdir(peft_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    input_ids = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(0))
    actor, base = run_distributed(_actor_logits, 1, hf_dir, ckpt, input_ids)[0]
    assert (actor - base).abs().max() > 1e-3, "the adapters must matter for this comparison"
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        peft_logits = PeftModel.from_pretrained(hf, peft_dir).eval()(input_ids=input_ids).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        merged_logits = merged(input_ids=input_ids).logits
    peft_diff = float((peft_logits - actor).abs().max())
    merged_diff = float((merged_logits - actor).abs().max())
    print(f"exported LoRA: max |logit diff| PEFT {peft_diff:.1e}, merged {merged_diff:.1e}")
    assert peft_diff <= 1e-5 and merged_diff <= 1e-5, (peft_diff, merged_diff)
