"""Shared prompts (model.prefix_sharing): the rows of a micro-batch that begin with the same prompt pack
it once (rlstack/workers/packing.py), RoPE rotates each answer from its row position (patch
shared_prefix_rope) and attention lets it see the prompt (megatron_bridge/sdpa_attention.py). The actor's
log-probs, the critic's values, both losses and one SGD step of each equal those of every row packed on
its own, at TP1 and TP2 on gloo ranks with the tiny Llama (tied head) and the tiny Qwen2 (untied head,
q/k/v biases); and the model saw each prompt once: T = the prompts once plus every row's own tokens."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.test_remove_padding import _run, assert_same_results

# (prompt id, prompt length, response length): prompts 0 and 1 sampled 3 times, 2 and 3 once
ROWS = [(0, 5, 3), (1, 3, 9), (0, 5, 7), (2, 4, 2), (1, 3, 1), (0, 5, 4), (3, 6, 5), (1, 3, 6)]


def _rollout(vocab: int):
    from rlstack.workers.batch import Rollout

    gen = torch.Generator().manual_seed(5)
    prompts = {pid: torch.randint(1, vocab, (p,), generator=gen).tolist() for pid, p, _ in ROWS}
    responses = [torch.randint(1, vocab, (r,), generator=gen).tolist() for _, _, r in ROWS]
    logprobs = [[-1.0] * len(r) for r in responses]
    ids = [pid for pid, _, _ in ROWS]
    rollout = Rollout.build([prompts[i] for i in ids], responses, logprobs, [0.0] * 8, ids, 0, 2, "cpu", True)
    rollout.advantages = torch.randn(rollout.resp_mask.shape, generator=gen) * rollout.resp_mask
    rollout.old_values = torch.randn(rollout.resp_mask.shape, generator=gen) * rollout.resp_mask
    rollout.returns = torch.randn(rollout.resp_mask.shape, generator=gen) * rollout.resp_mask
    return rollout


def _both(hf_dir: str, tp: int):
    from megatron_bridge.parallel import init_distributed

    groups = init_distributed(tp, 1)
    return tuple(_run(hf_dir, groups, True, True, shared, _rollout) for shared in (True, False))


@pytest.mark.parametrize("tp", [1, 2])
def test_shared_prompts_equal_rows_on_their_own(tiny_llama, tiny_qwen2, tp):
    for hf_dir in (tiny_llama, tiny_qwen2) if tp == 1 else (tiny_llama,):
        for shared, alone in run_distributed(_both, tp, hf_dir, tp):
            needed = shared["needed"]
            assert needed == [p + r for _, p, r in ROWS]
            # each pass (log-probs, values, two updates) packs every prompt once in 2 micro-batches
            prompts_once = sum(r for _, _, r in ROWS) + sum({pid: p for pid, p, _ in ROWS}.values())
            assert len(shared["seen"]) == 8 and len(alone["seen"]) == 8
            tokens = lambda run, k: sum(t for _, _, t, _ in run["seen"][k : k + 2])  # noqa: E731
            for k in range(0, 8, 2):
                assert tokens(shared, k) == prompts_once < tokens(alone, k) == sum(needed)
            assert_same_results(shared, alone)
