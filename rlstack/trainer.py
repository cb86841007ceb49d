"""The PPO/GRPO loop: sync -> rollout -> score -> advantages -> update -> record.

Every rank runs the same program (SPMD). Each rank hosts its shard of the actor, critic and
reference on the megatron TP/PP/DP groups, and a full rollout engine. Rollout work is split over
all ranks and gathered inside each model-parallel group, so TP/PP peers train on the same batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
import torch

from rlstack import collectives
from rlstack.algorithms import build_kl_controller, compute_advantages, place_at_last_token
from rlstack.algorithms.kl import apply_kl_penalty
from rlstack.config import ExperimentConfig, adv_estimator
from rlstack.observability.progress import progress
from megatron_bridge.parallel import ParallelGroups
from rlstack.rollout import sync_check
from rlstack.workers.actor import Actor, compute_logprobs
from rlstack.workers.batch import gather_objects, make_batch, scatter_to_tokens, split_for_rank
from rlstack.workers.critic import Critic
from rlstack.workers.megatron_role import MegatronRole, OptimSettings, warmup_steps
from rlstack.workers.step_metrics import reduce_stats

log = logging.getLogger("rlstack")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Trainer:
    def __init__(self, cfg: ExperimentConfig, groups: ParallelGroups):
        from megatron_bridge.hf import resolve_model_path
        from rlstack.data.dataset import build_datasets
        from rlstack.data.sampler import PromptSampler
        from rlstack.rewards import RewardScorer

        self.cfg, self.groups = cfg, groups
        self.hf_dir = resolve_model_path(cfg.model.path, tiny_spec=asdict(cfg.model.tiny),
                                         cache_dir=cfg.model.cache_dir)
        self.tokenizer = _load_tokenizer(self.hf_dir)
        self.train_set, self.val_set = build_datasets(cfg.data, self.tokenizer)
        self.sampler = PromptSampler(len(self.train_set), cfg.data.train_batch_size, seed=cfg.data.seed,
                                     shuffle=cfg.data.shuffle, dp_rank=groups.dp_rank, dp_size=groups.dims.dp)
        self.scorer = RewardScorer.from_config(cfg.data)
        self.scorer.check_sources(self.train_set.data_sources())
        if self.val_set is not None:
            self.scorer.check_sources(self.val_set.data_sources())
        self._build_models()
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl, cfg.algorithm.kl_coef,
                                           cfg.algorithm.kl_target, cfg.algorithm.kl_horizon)
        self.step = 0

    # ------------------------------------------------------------------ build

    def _build_models(self) -> None:
        from megatron_bridge.reshard import WeightSync
        from rlstack.rollout.base import build_engine

        cfg, g = self.cfg, self.groups
        a = cfg.algorithm
        dtype = DTYPES[cfg.model.dtype]
        optim = dict(weight_decay=a.weight_decay, clip_grad=a.clip_grad, adam_beta1=a.adam_beta1,
                     adam_beta2=a.adam_beta2, use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                     lr_schedule=a.lr_schedule, total_steps=cfg.trainer.total_steps, min_lr_ratio=a.min_lr_ratio)
        total = cfg.trainer.total_steps
        actor_optim = OptimSettings(lr=a.actor_lr, lr_warmup_steps=warmup_steps(
            a.actor_lr_warmup_steps, a.lr_warmup_ratio, total), **optim)
        critic_optim = OptimSettings(lr=a.critic_lr, lr_warmup_steps=warmup_steps(
            a.critic_lr_warmup_steps, a.lr_warmup_ratio, total), **optim)
        recompute = cfg.model.gradient_checkpointing
        self.actor = Actor(MegatronRole(self.hf_dir, g, dtype, optim=actor_optim,
                                        recompute=recompute), a, temperature=cfg.rollout.temperature)
        self.ref = MegatronRole(self.hf_dir, g, dtype) if self.needs_reference else None
        self.critic = None
        if a.name == "ppo":
            critic_dir = cfg.model.critic_path or self.hf_dir
            self.critic = Critic(MegatronRole(critic_dir, g, dtype, value_head=True, recompute=recompute,
                                              optim=critic_optim,
                                              value_head_seed=cfg.trainer.seed), a)
        self.engine = build_engine(cfg.rollout, self.hf_dir, g, self.tokenizer.eos_token_id,
                                   self.tokenizer.pad_token_id)
        self.weight_sync = WeightSync(self.actor.role.module, self.actor.role.args, g, self.engine,
                                      bucket_mb=cfg.rollout.sync_bucket_mb)

    @property
    def needs_reference(self) -> bool:
        a = self.cfg.algorithm
        return a.use_kl_loss or a.use_kl_in_reward

    # ------------------------------------------------------------------ one step

    def train_step(self, dry_run: bool = False) -> dict:
        cfg, g = self.cfg, self.groups
        timings, t_step = {}, time.perf_counter()
        t0 = time.perf_counter()
        sync_stats = self.weight_sync.sync()
        timings["timing/sync_s"] = time.perf_counter() - t0
        sync_check.after_sync(self, sync_stats)  # rollout.verify_sync: stale engine weights stop the run

        t0 = time.perf_counter()
        global_prompts = [self.train_set[i] for i in self.sampler.next_global_batch()]
        gens, gen_tokens = self.generate(global_prompts, greedy=False)
        prompts, gens = self._dp_shard(global_prompts, gens)
        timings["timing/rollout_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        batch, scores = self._score(prompts, gens)
        timings["timing/score_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        metrics = self._update(batch, forward_only=dry_run)
        sync_check.check_rollout_diff(cfg.rollout, self.step, metrics)
        timings["timing/update_s"] = time.perf_counter() - t0
        timings["timing/step_s"] = time.perf_counter() - t_step

        metrics.update(timings)
        metrics.update(sync_stats.as_metrics())
        metrics.update(self._rollout_metrics(scores, gens, gen_tokens, timings))
        metrics.update(self._reward_extra_metrics(over_dp=True))
        self._check_finite(metrics)
        self.step += 1
        return metrics

    def generate(self, prompts: list, greedy: bool):
        """Generate for `prompts` (the same list on every rank), the work split over all ranks.

        Rollout replicas (world / rollout.tp of them; a replica is one engine, spanning rollout.tp
        ranks for vLLM TP) each take a contiguous share, seeded by the replica index: the samples do
        not depend on the training layout. Returns (rows (prompt index, response ids, log-probs,
        finish reason) in prompt order on every rank, tokens generated by all ranks).
        """
        from rlstack.rollout.base import SamplingParams

        g, r = self.groups, self.cfg.rollout
        replicas, replica = g.dims.world_size // r.tp, g.rank // r.tp
        mine = split_for_rank(list(range(len(prompts))), replica, replicas)
        params = SamplingParams(n=1 if greedy else r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=r.max_new_tokens, greedy=greedy,
                                seed=r.seed + 7919 * self.step)  # reseeded per step: resume is exact
        rows = []
        for chunk in progress(self._chunks(mine, params.n), desc="validate" if greedy else "rollout",
                              enabled=self.cfg.logging.progress, rank=g.rank, unit="batch"):
            local = self.engine.generate([prompts[i].input_ids for i in chunk], params)
            rows += [(chunk[x.prompt_index], x.response_ids, x.logprobs, x.finish_reason) for x in local]
        if g.rank % r.tp:
            rows = []  # the replica's first rank reports for the whole replica
        rows = gather_objects(rows, g.world, g.dims.world_size)
        n_tokens = float(sum(len(x[1]) for x in rows))
        return rows, n_tokens

    def _chunks(self, items: list, n: int) -> list[list]:
        """hf engine: one micro-batch of sequences per call (a progress tick each); vLLM batches all."""
        if not items:
            return []
        size = len(items) if self.cfg.rollout.engine == "vllm" else max(1, self.cfg.rollout.micro_batch_size // n)
        return [items[i:i + size] for i in range(0, len(items), size)]

    def _dp_shard(self, prompts: list, rows: list):
        """This data-parallel rank's contiguous share of the prompts, and their generations."""
        g = self.groups
        share = split_for_rank(list(range(len(prompts))), g.dp_rank, g.dims.dp)
        first, mine = (share[0] if share else 0), set(share)
        return [prompts[i] for i in share], [(i - first, *rest) for (i, *rest) in rows if i in mine]

    def _score(self, prompts: list, gens: list):
        device = self.groups.device
        prompt_ids = [prompts[i].input_ids for i, *_ in gens]
        response_ids = [resp for _, resp, *_ in gens]
        scores = self._rewards(prompts, gens)
        mbs = self.cfg.algorithm.micro_batch_size
        batch = make_batch(prompt_ids, response_ids, self.tokenizer.pad_token_id, mbs, device)
        batch["scores"] = scatter_to_tokens(scores, batch)
        group_ids = [i for i, *_ in gens] + [-1] * (batch["tokens"].shape[0] - len(gens))
        batch["group_ids"] = torch.tensor(group_ids, dtype=torch.long, device=device)
        rollout_lp = torch.zeros_like(batch["resp_mask"])
        for row, (i, resp, lps, _) in enumerate(gens):
            start = len(prompts[i].input_ids)
            rollout_lp[row, start:start + len(resp)] = torch.tensor(lps, dtype=torch.float32)
        batch["rollout_logprob"] = rollout_lp
        batch["num_sequences"] = len(gens)
        batch["num_tokens"] = sum(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
        return batch, scores

    def _update(self, batch: dict, forward_only: bool) -> dict:
        cfg, a, g = self.cfg, self.cfg.algorithm, self.groups
        mbs = a.micro_batch_size
        metrics = {}
        if not self._on_policy():
            batch["old_logprob"] = compute_logprobs(self.actor.role, batch, mbs, self.cfg.rollout.temperature)
            metrics.update(self._engine_agreement(batch))
        if self.ref is not None:
            batch["ref_logprob"] = compute_logprobs(self.ref, batch, mbs, self.cfg.rollout.temperature)
        if self.critic is not None:
            batch["old_values"] = self.critic.compute_values(batch, mbs)
        metrics.update(self._advantages(batch))
        minis = _mini_batches(batch, a.mini_batch_size, g.dims.dp, mbs)
        actor_stats, critic_stats, grad_norms, critic_norms = [], [], [], []
        train_actor = self.step >= a.critic_warmup_steps
        actor_s = critic_s = 0.0
        for _ in range(a.ppo_epochs):
            for mini in minis:
                counts, scale = self._counts(mini)
                t0 = time.perf_counter()
                if self.critic is not None:
                    out = self.critic.update(mini, counts, mbs, scale, forward_only=forward_only)
                    critic_stats += out["stats"]
                    critic_norms.append(out["grad_norm"])
                t1 = time.perf_counter()
                if train_actor:
                    actor_inputs = {k: v for k, v in mini.items() if k not in ("old_values", "returns")}
                    out = self.actor.update(actor_inputs, counts, mbs, scale, forward_only=forward_only)
                    actor_stats += out["stats"]
                    grad_norms.append(out["grad_norm"])
                actor_s += time.perf_counter() - t1
                critic_s += t1 - t0
        metrics.update(self._train_throughput(batch, actor_s, critic_s))
        metrics.update(reduce_stats(actor_stats, g, len(minis) * a.ppo_epochs, "actor"))
        metrics.update(reduce_stats(critic_stats, g, len(minis) * a.ppo_epochs, "critic"))
        for key, norms in (("actor/grad_norm", grad_norms), ("critic/grad_norm", critic_norms)):
            if norms and not forward_only:
                metrics[key] = sum(norms) / len(norms)
        if not forward_only:  # the lr schedules count trainer steps (as verl's); the actor's only when it trained
            if train_actor:
                metrics["actor/lr"] = self.actor.role.lr_schedule.lr
                self.actor.role.lr_schedule.step()
            if self.critic is not None:
                metrics["critic/lr"] = self.critic.role.lr_schedule.lr
                self.critic.role.lr_schedule.step()
        return metrics

    # Step metrics that must stay finite; a non-finite one stops the run (or, for gradient norms
    # with trainer.on_nonfinite=skip, the update was skipped and the run goes on).
    _FINITE_LOSSES = ("actor/loss", "actor/pg_loss", "actor/kl", "actor/entropy", "critic/loss")
    _FINITE_NORMS = ("actor/grad_norm", "critic/grad_norm")

    def _check_finite(self, metrics: dict) -> None:
        from rlstack.workers.finite import DivergenceError, count_nonfinite, first_nonfinite

        step, skip = self.step + 1, self.cfg.trainer.on_nonfinite == "skip"
        modules = [self.actor.role.module] + ([self.critic.role.module] if self.critic is not None else [])
        bad_weights = collectives.sum_floats([float(count_nonfinite(modules))], self.groups.world, self.groups.device)[0]
        if bad_weights:
            raise DivergenceError(f"training diverged at step {step}: {int(bad_weights)} weight tensor(s) hold NaN/inf "
                                  f"after the optimizer step (nothing is saved from this step): lower "
                                  f"algorithm.actor_lr/critic_lr or algorithm.clip_grad")
        norm = first_nonfinite(metrics, self._FINITE_NORMS)
        loss = first_nonfinite(metrics, self._FINITE_LOSSES)
        if (norm or loss) and skip:
            log.warning("step %d: %s is %s: the update was skipped, weights unchanged (trainer.on_nonfinite=skip)",
                        step, norm or loss, metrics[norm or loss])
            metrics["trainer/skipped_update"] = 1.0
            return
        if norm or loss:
            key = norm or loss
            raise DivergenceError(f"training diverged at step {step}: {key} is {metrics[key]} (the optimizer step "
                                  f"was skipped; nothing is saved from this step): lower algorithm.actor_lr/critic_lr "
                                  f"or algorithm.clip_grad, or set trainer.on_nonfinite=skip to skip such updates")

    def _on_policy(self) -> bool:
        """One epoch over one mini-batch: the policy that sampled is the one being updated."""
        a = self.cfg.algorithm
        return a.ppo_epochs == 1 and a.mini_batch_size <= 0 and not a.use_kl_in_reward

    def _engine_agreement(self, batch: dict) -> dict:
        """How far the rollout engine's log-probs are from the actor's: a stale or wrong sync shows here."""
        mask = batch["resp_mask"]
        diff = (batch["rollout_logprob"] - batch["old_logprob"]).abs() * mask
        local_max = diff.max().item() if mask.any() else 0.0
        g = self.groups
        total, count = collectives.sum_floats([float(diff.sum()), float(mask.sum())], g.dp, g.device)
        diff_max = collectives.max_floats([local_max], g.world, g.device)[0]
        return {"actor/rollout_diff": total / max(count, 1.0), "actor/rollout_diff_max": diff_max}

    def _train_throughput(self, batch: dict, actor_s: float, critic_s: float) -> dict:
        """Tokens (prompt + response, all DP ranks) trained per second, per role."""
        g = self.groups
        local = float(batch["num_tokens"]) * self.cfg.algorithm.ppo_epochs
        tokens = collectives.sum_floats([local], g.dp, g.device)[0]
        out = {"timing/actor_update_s": actor_s}
        if actor_s > 0:
            out["throughput/actor_tok_s"] = tokens / actor_s
        if self.critic is not None and critic_s > 0:
            out["throughput/critic_tok_s"] = tokens / critic_s
            out["timing/critic_update_s"] = critic_s
        return out

    def _advantages(self, batch: dict) -> dict:
        a, g = self.cfg.algorithm, self.groups
        n = batch["num_sequences"]  # rows past n only fill the last micro-batch: no response, no reward
        mask = batch["resp_mask"][:n]
        token_rewards = place_at_last_token(batch["scores"][:n], mask)  # [n, S]
        metrics = {}
        if a.use_kl_in_reward:
            token_rewards, kl_mean = apply_kl_penalty(token_rewards, batch["old_logprob"][:n],
                                                      batch["ref_logprob"][:n], mask, self.kl_ctrl.value, a.kl_penalty)
            kl_mean = collectives.sum_floats([float(kl_mean)], g.dp, g.device)[0] / g.dims.dp
            self.kl_ctrl.update(kl_mean, n_steps=self.cfg.data.train_batch_size)
            metrics.update({"actor/reward_kl": kl_mean, "actor/kl_coef": self.kl_ctrl.value})
        estimator = adv_estimator(self.cfg)
        inputs = dict(token_rewards=token_rewards)
        if estimator == "gae":
            inputs["values"] = batch["old_values"][:n]
        adv, returns = compute_advantages(estimator, mask=mask, group_ids=batch["group_ids"][:n], gamma=a.gamma,
                                          lam=a.lam, reduce_fn=collectives.sum_over(g.dp, g.device), **inputs)
        rows = batch["resp_mask"].shape[0]
        batch["advantages"] = _pad_rows(adv.detach(), rows)
        batch["returns"] = _pad_rows(returns.detach(), rows)
        return metrics

    def _counts(self, mini: dict) -> tuple[dict, float]:
        g, mask = self.groups, mini["resp_mask"]
        tokens, seqs = collectives.sum_floats([float(mask.sum()), float((mask.sum(-1) > 0).sum())], g.dp, g.device)
        num_micro = mini["tokens"].shape[0] // self.cfg.algorithm.micro_batch_size
        # loss_scale_factor: the constant length of seq-mean-token-sum-norm (Dr.GRPO); other modes ignore it.
        scale_factor = float(self.cfg.algorithm.loss_scale_factor or self.cfg.rollout.max_new_tokens)
        return ({"global_num_tokens": tokens, "global_num_seqs": seqs, "loss_scale_factor": scale_factor},
                float(num_micro * g.dims.dp))

    def _rollout_metrics(self, scores: list, gens: list, gen_tokens: float, timings: dict) -> dict:
        g = self.groups
        local = [sum(scores), len(scores), sum(len(x[1]) for x in gens)]
        total, count, length = collectives.sum_floats(local, g.dp, g.device)
        sq = collectives.sum_floats([sum((s - total / count) ** 2 for s in scores)], g.dp, g.device)[0]
        rollout_s = max(timings["timing/rollout_s"], 1e-9)
        return {"reward/mean": total / count, "reward/std": (sq / count) ** 0.5,
                "response/length_mean": length / count, "throughput/rollout_tok_s": gen_tokens / rollout_s}

    # ------------------------------------------------------------------ validation

    def validate(self) -> dict:
        if self.val_set is None or len(self.val_set) == 0:
            return {}
        from rlstack.data.dataset import val_accuracy

        prompts = [self.val_set[i] for i in range(len(self.val_set))]
        gens, _ = self.generate(prompts, greedy=True)
        metrics = val_accuracy(self._rewards(prompts, gens), [prompts[i].data_source for i, *_ in gens])
        # every rank scored every validation response: no reduction over ranks
        metrics.update({"val/" + k: v for k, v in self._reward_extra_metrics(over_dp=False).items()})
        return metrics

    def _rewards(self, prompts: list, gens: list) -> list[float]:
        """Rule (or custom) score of each generated response against its prompt's ground truth."""
        from rlstack.rewards import Sample

        samples = [Sample(prompts[i].data_source, self.tokenizer.decode(resp, skip_special_tokens=True),
                          prompts[i].ground_truth, prompts[i].extra_info, row=prompts[i].index)
                   for i, resp, *_ in gens]
        self._reward_results = self.scorer.score_batch(samples)
        return [r.score for r in self._reward_results]

    def _reward_extra_metrics(self, over_dp: bool) -> dict:
        """`reward_extra/<key>`: means of the custom reward function's numeric extra dict keys (and
        the share of calls past data.reward_timeout_s) over the last scored samples. Ranks may see
        different keys, so (sum, count) pairs are all-gathered rather than all-reduced."""
        from rlstack.rewards import extras_sums, merge_extras_sums

        if self.scorer.custom_fn is None:
            return {}
        local = extras_sums(getattr(self, "_reward_results", []))
        g = self.groups
        parts = gather_objects([local], g.dp, g.dims.dp) if over_dp else [local]
        return merge_extras_sums(parts)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    pad = torch.zeros((rows - x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=0)


def _mini_batches(batch: dict, mini_batch_size: int, dp: int, mbs: int) -> list[dict]:
    """Split this rank's batch into mini-batches (global size / dp each, a multiple of mbs)."""
    size = batch["tokens"].shape[0]
    keys = [k for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == size]
    local = size if mini_batch_size <= 0 else max(mbs, (mini_batch_size // dp) // mbs * mbs)
    return [{k: batch[k][i:i + local] for k in keys} for i in range(0, size, local)]


def _load_tokenizer(hf_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok

