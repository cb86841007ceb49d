"""Rollout with a transformers model and a KV-cache decode loop (the CPU default engine).

The model's parameters stay addressable, so the weight-sync bridge overwrites them in place
(`param_targets`). `generate()` of transformers is not used: its per-step bookkeeping (logits
processors, stopping criteria, full-vocabulary logits of every prompt position) costs more than the
model on small CPUs. The loop here runs prefill once with `logits_to_keep=1`, then one token per step,
and drops finished rows from the batch (and its KV cache) as they stop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch

from rlstack.rollout.base import Generation, RolloutEngine, SamplingParams
from rlstack.rollout.sampling import sample_next

# Compact the batch (and its KV cache) once this share of its rows has stopped.
_COMPACT_FINISHED_SHARE = 0.25


@dataclass
class _Counters:
    tokens: int = 0
    sequences: int = 0
    seconds: float = 0.0


class HFEngine(RolloutEngine):
    kind = "hf"

    def __init__(self, hf_dir: str, rollout_cfg, device, eos_token_id: int, pad_token_id: int, seed: int = 0):
        from transformers import AutoModelForCausalLM

        self.cfg = rollout_cfg
        self.device = torch.device(device)
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(self.device)
        self.model.eval().requires_grad_(False)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.base_seed = seed
        self._seed_offset: Optional[int] = None
        self._generator: Optional[torch.Generator] = None
        self._counters = _Counters()

    # ------------------------------------------------------------------ weights

    def param_targets(self) -> dict[str, torch.Tensor]:
        # named_parameters() lists a tied lm_head once (as model.embed_tokens.weight), as HF saves it.
        return dict(self.model.named_parameters())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        targets = self.param_targets()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in targets:
                    raise ValueError(f"hf engine has no parameter {name!r}")
                if tuple(tensor.shape) != tuple(targets[name].shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != engine {tuple(targets[name].shape)}")
                targets[name].copy_(tensor)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        params.validate()
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        start = time.perf_counter()
        generator = self._sampler(params)
        rows = [(i, prompts[i]) for i in range(len(prompts)) for _ in range(params.n)]  # prompt-major
        # Similar lengths together: less left padding per micro-batch. Results go back in row order.
        order = sorted(range(len(rows)), key=lambda r: len(rows[r][1]))
        results: list[Optional[Generation]] = [None] * len(rows)
        mbs = max(1, self.cfg.micro_batch_size)
        for lo in range(0, len(order), mbs):
            chunk = order[lo : lo + mbs]
            for r, gen in zip(chunk, self._generate_batch([rows[r] for r in chunk], params, generator)):
                results[r] = gen
        self._counters.seconds += time.perf_counter() - start
        self._counters.sequences += len(rows)
        self._counters.tokens += sum(len(g.response_ids) for g in results)
        return results

    def _sampler(self, params: SamplingParams) -> torch.Generator:
        """One generator per engine, reseeded only when `params.seed` changes (successive calls differ)."""
        if self._generator is None or params.seed != self._seed_offset:
            self._generator = torch.Generator(device=self.device).manual_seed(self.base_seed + params.seed)
            self._seed_offset = params.seed
        return self._generator

    @torch.no_grad()
    def _generate_batch(
        self, rows: list[tuple[int, list[int]]], params: SamplingParams, generator: torch.Generator
    ) -> list[Generation]:
        from transformers import DynamicCache

        batch, max_len = len(rows), max(len(p) for _, p in rows)
        input_ids = torch.full((batch, max_len), self.pad_token_id, dtype=torch.long)  # [B, L] left-padded
        mask = torch.zeros((batch, max_len), dtype=torch.long)  # [B, L]
        for b, (_, prompt) in enumerate(rows):
            input_ids[b, max_len - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[b, max_len - len(prompt) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]  # [B, V]
        tokens = torch.empty((batch, params.max_new_tokens), dtype=torch.long)  # [B, N] on the host
        logprobs = torch.empty((batch, params.max_new_tokens), dtype=torch.float32)
        lengths = torch.full((batch,), params.max_new_tokens, dtype=torch.long)  # response length per row
        stopped = torch.zeros(batch, dtype=torch.bool)
        active = torch.arange(batch)  # original row of each live batch row
        next_pos = positions[:, -1] + 1  # [b]
        for step in range(params.max_new_tokens):
            tok, lp = sample_next(logits, params, generator)  # [b], [b]
            tokens[active, step], logprobs[active, step] = tok.cpu(), lp.float().cpu()
            newly = (tok == self.eos_token_id).cpu() & ~stopped[active]  # [b]
            lengths[active[newly]] = step + 1
            stopped[active[newly]] = True
            if step == params.max_new_tokens - 1 or bool(stopped.all()):
                break
            keep = ~stopped[active]  # [b]; stopped rows still in the batch decode on, unread
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # [b, L+step+1]
            if (~keep).float().mean() >= _COMPACT_FINISHED_SHARE:
                idx = keep.nonzero().squeeze(-1).to(self.device)
                cache.batch_select_indices(idx)
                tok, mask, next_pos, active = tok[idx], mask[idx], next_pos[idx], active[keep]
            logits = self.model(
                input_ids=tok.unsqueeze(-1),
                attention_mask=mask,
                position_ids=next_pos.unsqueeze(-1),
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]  # [b, V]
            next_pos = next_pos + 1
        return [
            self._row_result(rows[b], tokens[b], logprobs[b], int(lengths[b]), bool(stopped[b])) for b in range(batch)
        ]

    @staticmethod
    def _row_result(row, tokens, logprobs, length: int, stopped: bool) -> Generation:
        prompt_index, prompt = row
        return Generation(
            prompt_index=prompt_index,
            prompt_ids=list(prompt),
            response_ids=tokens[:length].tolist(),
            logprobs=logprobs[:length].tolist(),
            finish_reason="stop" if stopped else "length",
        )

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict:
        c, self._counters = self._counters, _Counters()
        return {
            "rollout/tokens": c.tokens,
            "rollout/sequences": c.sequences,
            "rollout/seconds": c.seconds,
            "rollout/tokens_per_s": c.tokens / c.seconds if c.seconds > 0 else 0.0,
        }
