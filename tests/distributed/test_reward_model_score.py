"""`RewardModel.score` on rollout batches equals transformers' pooled sequence-classification score.

The rollout's rows (chat-templated prompts + responses, some stopped at eos, some cut at the length
limit, of different lengths: right padding and a filler row in the last micro-batch) go through
`rm_inputs` and `RewardModel.score` on 2 gloo ranks at TP1 x DP2, TP2 and PP2, with the tiny Llama
and Qwen2 reward models. The reference is transformers' `AutoModelForSequenceClassification`
pooled logit of each row alone, with its pad token set to an id no row holds: transformers then
pools at each row's last token, eos included, which is where rlstack reads (docs/reward_model.md:
with pad = eos, transformers' default would read the token before a trailing eos). A score read at
the wrong position (e.g. position 0 of each row) fails.
"""

import pytest
import torch

from tests.dist_utils import run_distributed

TOL = 1e-4
LAYOUTS = [(1, 1), (2, 1), (1, 2)]
CONTENTS = ["What is 2 plus 3?", "Copy: 7", "Name a prime number above 10, then explain", "Hi", "Sum 12 and 30"]
ANSWERS = ["5", "7 7 7 7 7 7", "11", "Hello there, how are you today?", "42"]


def _rollout(tok):
    """Prompts and generations as the rollout hands them to the reward stage (shared tokenizer)."""
    from rlstack.data.dataset import Prompt
    from rlstack.rollout.base import Generation

    prompts, gens = [], []
    for i, (content, answer) in enumerate(zip(CONTENTS, ANSWERS)):
        messages = [{"role": "user", "content": content}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(Prompt(index=i, input_ids=list(ids), data_source="rm", ground_truth="", messages=messages))
        response = tok(answer, add_special_tokens=False)["input_ids"]
        stopped = i % 2 == 0  # stopped rows end with eos, the others were cut at max_new_tokens
        response = response + [tok.eos_token_id] if stopped else response
        gens.append(Generation(i, list(ids), response, [0.0] * len(response), "stop" if stopped else "length"))
    return prompts, gens


def _score_worker(rm_dir):
    """`RewardModel.score` of the rollout at each layout in one 2-rank world -> ([n] scores per layout, rows)."""
    from megatron.core import parallel_state as ps

    from megatron_bridge.parallel import init_distributed
    from rlstack import stages
    from rlstack.config import RewardModelConfig
    from rlstack.workers.megatron_role import MegatronRole
    from rlstack.workers.reward_model import RewardModel, rm_inputs

    tok = stages.load_tokenizer(rm_dir)
    prompts, gens = _rollout(tok)
    out = []
    for tp, pp in LAYOUTS:
        groups = init_distributed(tp, pp)
        role = MegatronRole(rm_dir, groups, torch.float32, value_head=True)
        rm = RewardModel(role, tok, RewardModelConfig(path=rm_dir, micro_batch_size=2), tok)
        assert rm.shared, "the same tokenizer: the rollout's own tokens are scored"
        inputs = rm_inputs(prompts, gens, tok, tok, rm.shared)
        out.append(rm.score(inputs))
        ps.destroy_model_parallel()
    return out, inputs.ids


def _transformers_scores(rm_dir, rows):
    """transformers' pooled score of each row alone, pooled at its last token (eos included)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    unused = next(i for i in range(model.config.vocab_size) if all(i not in r for r in rows))
    model.config.pad_token_id = unused  # so a trailing eos (= the tiny models' pad) is not taken for padding
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), unused, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_reward_model_score_equals_transformers_pooled(arch, tiny_cache):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_reward_model

    rm_dir = ensure_tiny_reward_model(TinySpec(arch=arch, tie_word_embeddings=arch == "llama", seed=3), tiny_cache)
    per_rank = run_distributed(_score_worker, 2, rm_dir, timeout=180)
    rows = per_rank[0][1]
    assert len({len(r) for r in rows}) == len(rows), "rows of different lengths: padding must not matter"
    ref = _transformers_scores(rm_dir, rows)
    assert ref.std() > 0.1, "scores must differ between rows, or the comparison proves little"
    for scores, _ in per_rank:
        for (tp, pp), got in zip(LAYOUTS, scores):
            assert got.shape == ref.shape, (got.shape, ref.shape)
            diff = (got - ref).abs().max().item()
            assert diff < TOL, (
                f"{arch} TP{tp} x PP{pp}: RewardModel.score {got.tolist()} vs transformers {ref.tolist()}"
            )
