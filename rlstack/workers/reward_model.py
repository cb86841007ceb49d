"""The fourth role: a learned reward model, forward-only, colocated with the actor, critic and reference.

The checkpoint is an HF `*ForSequenceClassification` with one label (the format OpenRLHF, verl and
TRL load); the bridge reads its body into a Megatron GPTModel on the same TP/PP/DP groups and its
`score.weight` into the scalar head (megatron_bridge.hf.build_megatron_from_hf). A response's score
is the head's output at the response's last token.

Tokenisation: when the reward model's tokenizer encodes a probe string like the actor's (same
vocabulary size and ids), the rollout's own tokens go in unchanged; otherwise prompt + response are
re-tokenised as text with the reward model's tokenizer, through its chat template when it has one
(verl's `_switch_chat_template`). The path taken is logged once.

Rewards: `reward = rule + weight * rm`, with rule 0 where no rule scorer applies to the sample's
data source (and no custom reward file or data.reward_scorer is set): the RM alone. RM scores may be
standardised over the step's batch (all DP ranks) and clipped before they are weighted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rlstack import collectives
from rlstack.workers.megatron_role import MegatronRole, cat_stats, split_micro_batches

log = logging.getLogger("rlstack")

PROBE = "Hello, world! What is 12 plus 30? #### 42\n<|im_start|>user\nCopy 7<|im_end|>"


# ----------------------------------------------------------------------------- tokenisation


def same_tokenizer(actor_tok, rm_tok, probe: str = PROBE) -> bool:
    """Do both tokenizers give the same ids (and vocabulary size)? Then token ids can be shared."""
    if len(actor_tok) != len(rm_tok) or actor_tok.eos_token_id != rm_tok.eos_token_id:
        return False
    return (
        actor_tok(probe, add_special_tokens=False)["input_ids"] == rm_tok(probe, add_special_tokens=False)["input_ids"]
    )


def retokenize(rm_tok, messages: list, prompt_text: str, response_text: str) -> list[int]:
    """Prompt + response as the reward model's tokenizer (and chat template) writes them.

    With a chat template and the prompt's messages, the response becomes the assistant turn; without
    one, the actor's rendered prompt text and the response text are encoded as one string.
    """
    if getattr(rm_tok, "chat_template", None) and messages:
        chat = list(messages) + [{"role": "assistant", "content": response_text}]
        ids = rm_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=False, return_dict=False)
        return [int(i) for i in ids]
    return list(rm_tok(prompt_text + response_text)["input_ids"])


@dataclass
class RMInputs:
    """Token rows for the reward model, and where each row's score is read."""

    ids: list[list[int]]
    last: list[int]  # index of each row's last token


def rm_inputs(prompts: list, gens: list, actor_tok, rm_tok, shared: bool) -> RMInputs:
    """One row per generation: the rollout's own tokens (`shared`) or a re-tokenised copy."""
    rows = []
    for g in gens:
        prompt = prompts[g.prompt_index]
        if shared:
            rows.append(list(prompt.input_ids) + list(g.response_ids))
        else:
            prompt_text = actor_tok.decode(prompt.input_ids, skip_special_tokens=False)
            response_text = actor_tok.decode(g.response_ids, skip_special_tokens=True)
            rows.append(retokenize(rm_tok, getattr(prompt, "messages", []), prompt_text, response_text))
    return RMInputs(ids=rows, last=[max(0, len(r) - 1) for r in rows])


def pad_batch(inputs: RMInputs, pad_id: int, multiple_of: int, device) -> dict[str, torch.Tensor]:
    """Right-padded `tokens`/`position_ids` [B', S] and `last` [B'] (B' a multiple of the micro-batch)."""
    n = len(inputs.ids)
    rows = max(1, -(-n // multiple_of)) * multiple_of  # an empty rank still joins the TP/PP forward
    seq_len = max((len(r) for r in inputs.ids), default=1)
    tokens = torch.full((rows, seq_len), pad_id, dtype=torch.long)
    for i, r in enumerate(inputs.ids):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    last = torch.zeros(rows, dtype=torch.long)
    last[:n] = torch.tensor(inputs.last, dtype=torch.long)
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(rows, -1).contiguous()
    return {"tokens": tokens.to(device), "position_ids": position_ids.to(device), "last": last.to(device)}


# ----------------------------------------------------------------------------- maths


def normalize_and_clip(scores: torch.Tensor, normalize: bool, clip: float, reduce_fn=None) -> torch.Tensor:
    """[n] RM scores -> standardised over the batch (`reduce_fn` sums over DP ranks) and clipped."""
    out = scores.float()
    if normalize:
        sums = torch.stack([out.sum(), (out * out).sum(), torch.tensor(float(out.numel()))])
        sums = reduce_fn(sums) if reduce_fn is not None else sums
        mean = sums[0] / sums[2].clamp(min=1.0)
        var = (sums[1] / sums[2].clamp(min=1.0) - mean * mean).clamp(min=0.0)
        out = (out - mean) / (var.sqrt() + 1e-6)
    if clip > 0:
        out = out.clamp(-clip, clip)
    return out


def mix(rule: list[Optional[float]], rm: list[float], weight: float) -> list[float]:
    """reward = rule + weight * rm per sample; rule None (no scorer applies) counts as 0: the RM alone."""
    return [(r or 0.0) + weight * s for r, s in zip(rule, rm)]


def rule_applies(scorer, data_source: str) -> bool:
    """Does a rule or custom reward score this data source (else the RM alone rewards it)?"""
    from rlstack.rewards import SCORERS

    return scorer.custom_fn is not None or bool(scorer.builtin) or data_source in SCORERS


# ----------------------------------------------------------------------------- the role


@dataclass
class RewardOutput:
    scores: list[float]  # the mixed reward per generation
    results: list  # rule ScoreResults per generation (score 0 where no rule applies)
    metrics: dict = field(default_factory=dict)


class RewardModel:
    """A frozen scalar-head GPTModel stage and the reward model's tokenizer."""

    def __init__(self, role: MegatronRole, tokenizer: Any, cfg: Any, actor_tokenizer: Any):
        self.role, self.tokenizer, self.cfg = role, tokenizer, cfg  # cfg: rlstack.config.RewardModelConfig
        self.shared = same_tokenizer(actor_tokenizer, tokenizer)
        if role.groups.rank == 0:
            log.info(
                "reward model %s: %s",
                cfg.path,
                "same tokenizer as the actor: scoring the rollout's tokens"
                if self.shared
                else "tokenizer differs from the actor's: re-tokenising prompt + response with the reward "
                "model's tokenizer" + (" and chat template" if getattr(tokenizer, "chat_template", None) else ""),
            )

    def score(self, inputs: RMInputs) -> torch.Tensor:
        """[n] the head's output at each row's last token, on every rank of the model replica."""
        g, mbs = self.role.groups, self.cfg.micro_batch_size
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        batch = pad_batch(inputs, pad_id, mbs, g.device)

        def loss_fn(mb, output):  # output [b, S, 1]
            picked = output[..., 0].float().gather(1, mb["last"][:, None])[:, 0]  # [b]
            return torch.zeros((), device=output.device), {"scores": picked}

        stats = self.role.run(split_micro_batches(batch, mbs), loss_fn, forward_only=True)
        out = cat_stats(stats, "scores") if g.is_last_stage else None
        rows = batch["tokens"].shape[0]
        out = self.role.broadcast_from_last_stage(out, (rows,), torch.float32)
        return out[: len(inputs.ids)].cpu()

    def rewards(self, scorer, actor_tok, prompts: list, gens: list, over_dp: bool) -> RewardOutput:
        """Rule (where one applies) + weight x RM score per generation, and the reward/* metrics."""
        from rlstack import stages
        from rlstack.rewards import ScoreResult

        g, c = self.role.groups, self.cfg
        ruled = [i for i, x in enumerate(gens) if rule_applies(scorer, prompts[x.prompt_index].data_source)]
        results = [ScoreResult(0.0) for _ in gens]
        for i, r in zip(ruled, stages.score(scorer, actor_tok, prompts, [gens[i] for i in ruled])):
            results[i] = r
        t0 = time.perf_counter()
        inputs = rm_inputs(prompts, gens, actor_tok, self.tokenizer, self.shared)
        raw = self.score(inputs)  # [n]
        rm_s = time.perf_counter() - t0
        reduce_fn = collectives.sum_over(g.dp, g.device) if over_dp and g.dims.dp > 1 else None
        used = normalize_and_clip(raw, c.normalize, c.clip, reduce_fn)
        rule: list[Optional[float]] = [None] * len(gens)
        for i in ruled:
            rule[i] = results[i].score
        scores = mix(rule, used.tolist(), c.weight)
        metrics = self._metrics(raw, [r.score for r in results], inputs, rm_s, over_dp)
        return RewardOutput(scores=scores, results=results, metrics=metrics)

    def _metrics(self, raw: torch.Tensor, rule: list[float], inputs: RMInputs, rm_s: float, over_dp: bool) -> dict:
        """Means over the step's samples (all DP ranks in training; every rank scored all in validation)."""
        g = self.role.groups
        local = [float(raw.sum()), float((raw * raw).sum()), float(sum(rule)), float(len(rule))]
        local.append(float(sum(len(r) for r in inputs.ids)))
        total = collectives.sum_floats(local, g.dp, g.device) if over_dp else local
        s, sq, rule_sum, n, tokens = total
        n = max(n, 1.0)
        mean = s / n
        return {
            "reward/rm_mean": mean,
            "reward/rm_std": max(sq / n - mean * mean, 0.0) ** 0.5,
            "reward/rule_mean": rule_sum / n,
            "throughput/rm_tok_s": tokens / max(rm_s, 1e-9),
        }


def build_reward_model(cfg, groups, actor_tokenizer, dtype) -> Optional[RewardModel]:
    """The reward model of `cfg.reward_model` on `groups` (None when reward_model.path is empty)."""
    from rlstack import stages

    rm = cfg.reward_model
    if not rm.path:
        return None
    role = MegatronRole(rm.path, groups, dtype, value_head=True)  # frozen: no optimizer
    return RewardModel(role, stages.load_tokenizer(rm.path), rm, actor_tokenizer)
