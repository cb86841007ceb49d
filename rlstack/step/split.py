"""Split-placement rollout source: rollout-only ranks generate (rlstack/placement.py, docs/placement.md).

staleness 0: request batch t with weights t, wait, train. Without a reward model the batch is
streamed: each rollout micro-batch is scored (rewards and score forwards) while the rollout ranks
generate the next one. staleness 1: batch t was generated during step t-1 with weights t-1 (kept
as `pending`, and in checkpoints); batch t+1 is requested with weights t before the update and
received after it (`after_update`), so generation and training overlap.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from rlstack import stages
from rlstack.step import StepBatch
from rlstack.step.scoring import Scores


class SplitSource:
    """`RolloutSource` (rlstack/step/__init__.py) over a `rlstack.placement.RolloutClient`."""

    on_policy = False  # the batch's old log-probs come from the score forwards (DAPO's rounds read this)

    def __init__(self, cfg, groups, client, train_set, sampler, tokenizer, scoring, forwards):
        self.cfg, self.groups, self.client = cfg, groups, client
        self.train_set, self.sampler, self.tokenizer = train_set, sampler, tokenizer
        self.scoring, self.forwards = scoring, forwards
        self.pending = None  # staleness k >= 1: (prompt indices, RolloutBatch) of the next step
        self._ahead = []  # prompt indices of the batches queued on the rollout ranks, oldest first (<= k)
        self._received = []  # (indices, RolloutBatch) taken off that queue before a checkpoint, oldest first
        self._waited = 0.0  # seconds this step waited for the rollout ranks so far
        self._inflight = None  # rollout.partial: the rollout ranks' queue as saved with the last checkpoint
        self._restore = None  # rollout.partial, resumed: the in-flight batches to hand back to the rollout ranks

    def next_batch(self, step: int) -> StepBatch:
        from megatron_bridge.reshard import SyncStats
        from rlstack.placement import RolloutRequest

        cfg, g = self.cfg, self.groups
        t0, self._waited = time.perf_counter(), 0.0
        sync = streamed = None
        if self._restore is not None:  # rollout.partial: before any weights reach the resumed rollout ranks
            self.client.request(RolloutRequest("restore", sync=False, inflight=self._restore))
            self._restore = None
        probed = self._probe(step)  # rollout.verify_sync when due: the probe request carries the sync
        if self.pending is None and self.scoring.reward_model is None:  # score each micro-batch as it arrives
            indices = self.sampler.next_global_batch()
            batch, sync, waited, streamed = self._stream(indices, step, probed is None)
            self.pending, self._waited = (indices, batch), self._waited + waited
        elif self.pending is None:  # a reward model normalises over the whole batch: no streaming
            indices = self.sampler.next_global_batch()
            prompts = [self.train_set[i] for i in indices]
            batch, waited, sync = self.client.generate(prompts, step, step, greedy=False, sync=probed is None)
            self.pending, self._waited = (indices, batch), self._waited + waited
        indices, batch = self.pending
        self.pending = None
        ahead = self._request_ahead(step, send_weights=probed is None)
        sync = probed or ahead or sync
        token_age = check_token_versions(batch, step, cfg.rollout.staleness)
        partial_metrics = {}
        if cfg.rollout.partial:  # tokens too old out of the loss, before scoring builds the loss masks
            batch, partial_metrics = _partial_mask(batch, cfg.rollout.partial_mask_older_than)
        timings = {"timing/rollout_s": batch.generate_s}  # the rollout ranks' busy time for this batch
        if streamed is not None:
            prompts, gens, scores, rollout, timings["timing/score_s"] = streamed
            timings["timing/sync_s"] = sync.seconds
        else:
            timings["timing/sync_s"] = time.perf_counter() - t0 - self._waited
            global_prompts = [self.train_set[i] for i in indices]
            prompts, gens = stages.dp_share(
                global_prompts, batch.gens, g, cfg.trainer.balance_batch, stages.shares_prompts(cfg)
            )
            t0 = time.perf_counter()
            scores = self.scoring.score(prompts, gens)
            rollout = self._build_rollout(prompts, gens, scores.values)
            timings["timing/score_s"] = time.perf_counter() - t0
        timings["timing/trainer_wait_rollout"] = self._waited
        metrics = {
            "rollout/staleness": float(step - batch.version),
            "rollout/token_staleness_max": float(token_age[1]),
            "rollout/token_staleness_mean": token_age[0],
            "timing/rollout_wait_weights": batch.wait_weights_s,
            **partial_metrics,
        }
        # staleness 1, last step: nothing generated ahead, no weights sent
        return StepBatch(prompts, gens, scores, rollout, sync or SyncStats(), batch.tokens, timings, metrics)

    def _probe(self, step: int):
        """`rollout.verify_sync` in split placement: when due, a greedy request for the probe prompts
        carries this step's sync; the training ranks hold the engine's log-probs to the actor's
        (sync_check.after_split_sync). Greedy decoding draws no sampling noise, so the step's own
        rollout is unchanged. Returns the sync's SyncStats, or None when no probe is due."""
        from rlstack.placement import RolloutRequest
        from rlstack.rollout import sync_check

        r = self.cfg.rollout
        if not sync_check.due(r, step):
            return None
        ids = sync_check.probe_prompts(self.train_set)
        tokens = min(sync_check.PROBE_TOKENS, r.max_new_tokens)
        sync = self.client.request(RolloutRequest("generate", ids, step, step, greedy=True, max_new_tokens=tokens))
        batch, waited = self.client.receive()
        self._waited += waited
        sync_check.after_split_sync(r, step, sync, self.forwards.actor.role, self.groups, batch.gens)
        return sync

    def _request_ahead(self, step: int, send_weights: bool):
        """staleness k: keep k batches queued on the rollout ranks, each new one generated with this
        step's weights (sent once, with the first request of the step). Batch s is sampled with step s's
        seed, and the sampler is drawn in step order, as in the synchronous run. Returns the SyncStats
        of the weights sent, or None."""
        from rlstack.placement import RolloutRequest

        cfg, sync = self.cfg, None
        while len(self._received) + len(self._ahead) < cfg.rollout.staleness:
            target = step + 1 + len(self._received) + len(self._ahead)  # the step that trains this batch
            if target >= cfg.trainer.total_steps:
                break
            indices = self.sampler.next_global_batch()
            ids = [list(self.train_set[i].input_ids) for i in indices]
            req = RolloutRequest("generate", ids, target, step, sync=send_weights and sync is None, queue=True)
            sync = self.client.request(req) or sync
            self._ahead.append(indices)
        if cfg.rollout.partial and send_weights and sync is None and self._ahead:
            # nothing new requested, batches in flight: the new weights still interrupt them
            sync = self.client.request(RolloutRequest("weights", [], step, step))
        return sync

    def after_update(self, step: int) -> dict:
        if self.cfg.rollout.partial:
            return self._after_update_partial(step)
        if self._checkpoint_after(step):  # take every queued batch off the rollout ranks: saved with the step
            while self._ahead:
                batch, waited = self.client.receive_queued()
                self._received.append((self._ahead.pop(0), batch))
                self._waited += waited
        if self._received:
            self.pending = self._received.pop(0)
        elif self._ahead:
            next_batch, waited = self.client.receive_queued()  # the oldest queued batch: trained next step
            self.pending = (self._ahead.pop(0), next_batch)
            self._waited += waited
        else:
            return {}
        return {"timing/trainer_wait_rollout": self._waited}

    def _after_update_partial(self, step: int) -> dict:
        """rollout.partial: the oldest queued batch is finished and received; before a checkpoint the
        rest are not (finishing them early would change their tokens' versions) but copied as they are
        (`snapshot`) and saved with the step, to be handed back on resume."""
        from rlstack.placement import RolloutRequest

        if not self._ahead:
            return {}
        next_batch, waited = self.client.receive_queued()
        self.pending, self._waited = (self._ahead.pop(0), next_batch), self._waited + waited
        self._inflight = None
        if self._checkpoint_after(step) and self._ahead:
            self.client.request(RolloutRequest("snapshot", sync=False))
            self._inflight, _ = self.client.receive_parts()
        return {"timing/trainer_wait_rollout": self._waited}

    def generate(self, prompts: list, step: int, greedy: bool):
        """The rollout ranks generate, with the current weights."""
        batch, _, _ = self.client.generate(prompts, step, step, greedy)
        return batch.gens, batch.tokens

    def _checkpoint_after(self, step: int) -> bool:
        """Whether rlstack.checkpoint saves after 0-based `step` (its maybe_save rule)."""
        every, done = self.cfg.checkpoint.save_every, step + 1
        return every > 0 and (done % every == 0 or done == self.cfg.trainer.total_steps)

    def state_dict(self) -> dict:
        """The batches generated ahead (with older weights) are saved, so a resumed run trains on
        exactly the batches the uninterrupted one would have. At staleness k > 1 the batches still
        queued on the rollout ranks were taken off before the save (`after_update`), both in the run
        that is later killed and in the uninterrupted one, so the two stay identical."""
        from rlstack.placement import pending_state

        state = {"pending": pending_state(self.pending), "received": [pending_state(x) for x in self._received]}
        # rollout.partial: the batches still in flight, their prompts and each replica's samples (a save
        # at another step, a preemption's, has no snapshot: the resumed run requests new batches)
        if self.cfg.rollout.partial and self._ahead and self._inflight is not None:
            state["ahead"], state["inflight"] = [list(x) for x in self._ahead], self._inflight
        return state

    def load_state_dict(self, state: dict) -> None:
        from rlstack.placement import pending_from_state

        self.pending = pending_from_state(state.get("pending"))
        self._received = [pending_from_state(x) for x in state.get("received", [])]
        self._ahead = [list(x) for x in state.get("ahead", [])]
        self._restore = state.get("inflight") if self._ahead else None

    def close(self, ok: bool) -> None:
        if ok:  # after an error a training rank may not answer: the launcher stops the rollout ranks
            self.client.stop()

    def _build_rollout(self, prompts: list, gens: list, scores: list):
        pad, mbs = self.tokenizer.pad_token_id, self.cfg.algorithm.micro_batch_size
        return stages.build_rollout(prompts, gens, scores, pad, mbs, self.groups.device, on_policy=False)

    def _stream(self, indices: list, step: int, sync: bool = True):
        """The synchronous batch scored part by part: rewards, old/reference log-probs and values of
        each rollout micro-batch while the rollout ranks generate the next one.

        Returns (RolloutBatch, SyncStats, seconds waited, (prompts, gens, Scores, Rollout, score seconds)).
        Every row's forwards are those of the whole-batch path (right padding: a row's positions do
        not depend on the batch's width).
        """
        from rlstack.placement import RolloutRequest
        from rlstack.workers.batch import split_for_rank

        g = self.groups
        global_prompts = [self.train_set[i] for i in indices]
        share = split_for_rank(list(range(len(indices))), g.dp_rank, g.dims.dp)
        first, in_share = (share[0] if share else 0), set(share)
        prompts = [global_prompts[i] for i in share]
        req = RolloutRequest("generate", [list(p.input_ids) for p in global_prompts], step, step, sync=sync)
        every, parts, results, busy = [], [], [], 0.0
        penalties = []  # overlong penalties in arrival order (only their sums are logged)
        for chunk in self.client.stream(req):
            t0 = time.perf_counter()
            every += chunk
            mine = [
                dataclasses.replace(x, prompt_index=x.prompt_index - first) for x in chunk if x.prompt_index in in_share
            ]
            if mine:
                scores = self.scoring.score(prompts, mine)
                results += zip(mine, scores.results)
                penalties += scores.penalties
                part = self._build_rollout(prompts, mine, scores.values)
                self.forwards.fill(part)
                parts.append((mine, scores.values, part))
            busy += time.perf_counter() - t0
        t0 = time.perf_counter()
        meta, sync, waited = self.client.last_stream
        rows = sorted(
            ((x, sc) for mine, values, _ in parts for x, sc in zip(mine, values)), key=lambda r: r[0].prompt_index
        )
        gens, values = [x for x, _ in rows], [sc for _, sc in rows]
        rollout = self._build_rollout(prompts, gens, values)
        fill_from_parts(rollout, gens, parts)
        batch = dataclasses.replace(meta, gens=sorted(every, key=lambda x: x.prompt_index))
        result_of = {id(x): res for x, res in results}  # in the rollout's row order (gdpo reads them per row)
        scores = Scores(values, [result_of[id(x)] for x in gens], penalties=penalties)
        return batch, sync, waited, (prompts, gens, scores, rollout, busy + time.perf_counter() - t0)


def check_token_versions(batch, step: int, staleness: int) -> tuple[float, int]:
    """(mean, max) over the batch's response tokens of `step` minus the weights version that produced
    the token. A token more than `staleness` versions old must not reach the loss: raising here stops
    a queue that ran further ahead than rollout.staleness allows."""
    ages = [step - v for g in batch.gens for v in (g.versions or [batch.version] * len(g.response_ids))]
    if not ages:
        return 0.0, 0
    worst = max(ages)
    if worst > staleness:
        raise RuntimeError(
            f"step {step + 1}: a token {worst} weight versions old reached the loss (rollout.staleness={staleness})"
        )
    return sum(ages) / len(ages), worst


def _partial_mask(batch, older_than: int):
    """rollout.partial: the batch with tokens of interrupted samples masked out of the loss by age,
    and the metrics of its in-flight history (rlstack.rollout.partial)."""
    from rlstack.rollout import partial

    gens, masked = partial.mask_older(batch.gens, older_than)
    metrics = {
        "rollout/partial_masked_frac": masked,
        "rollout/partial_interrupted_frac": partial.interrupted_share(gens),
    }
    return dataclasses.replace(batch, gens=gens), metrics


def fill_from_parts(rollout, gens: list, parts: list) -> None:
    """Copy each streamed part's per-row forwards into the whole batch's rows (`gens` order).

    A part's tensors are [b, S_part] with S_part <= S: columns past S_part are padding (zero).
    """
    row_of = {id(x): r for r, x in enumerate(gens)}
    for name in ("old_logprob", "ref_logprob", "old_values", "sum_pi_squared"):
        if not parts or getattr(parts[0][2], name, None) is None:
            continue
        like = getattr(parts[0][2], name)
        full = torch.zeros(rollout.tokens.shape, dtype=like.dtype, device=like.device)  # [B', S]
        for mine, _, part in parts:
            values = getattr(part, name)  # [b, S_part]
            for k, x in enumerate(mine):
                full[row_of[id(x)], : values.shape[1]] = values[k]
        setattr(rollout, name, full)
