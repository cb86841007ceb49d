"""The stages of one step as plain functions: rollout split, data-parallel share, scoring, batch.

The trainer calls these, and so do the benchmarks' stage timings (benchmarks/stages.py): both
measure the same code. Inputs are passed in (engine, groups, configs); nothing reaches into a trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from rlstack.observability.progress import progress
from rlstack.workers.batch import Rollout, gather_objects, split_for_rank

if TYPE_CHECKING:
    from megatron_bridge.parallel import ParallelGroups
    from rlstack.config import RolloutConfig
    from rlstack.data.dataset import PromptDataset
    from rlstack.data.sampler import PromptSampler
    from rlstack.rollout.base import Generation, RolloutEngine

SEED_STRIDE = 7919  # sampling seed of step s: rollout.seed + SEED_STRIDE * s (resume is exact)


def load_tokenizer(hf_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


@dataclasses.dataclass
class RunData:
    """The model directory, tokenizer, prompts and sampler of a run (`build_data`)."""

    hf_dir: str  # the actor's HF checkpoint directory (model.path resolved)
    tokenizer: Any  # a transformers tokenizer (pad token set)
    train_set: PromptDataset
    val_set: Optional[PromptDataset]
    sampler: PromptSampler


def build_data(cfg, groups: ParallelGroups) -> RunData:
    """The config's model directory, tokenizer, datasets and sampler, as the trainer and the benchmarks use them."""
    from megatron_bridge.hf import resolve_model_path
    from rlstack.agent.setup import check_agent_rows, prompt_tool_schemas
    from rlstack.data.dataset import build_datasets
    from rlstack.data.sampler import PromptSampler

    hf_dir = resolve_model_path(cfg.model.path, tiny_spec=cfg.model.tiny, cache_dir=cfg.model.cache_dir)
    tokenizer = load_tokenizer(hf_dir)
    train_set, val_set = build_datasets(cfg.data, tokenizer, prompt_tool_schemas(cfg.rollout) or None)
    check_agent_rows(cfg, train_set, val_set)
    d = cfg.data
    sampler = PromptSampler(
        len(train_set),
        d.train_batch_size,
        seed=d.seed,
        shuffle=d.shuffle,
        dp_rank=groups.dp_rank,
        dp_size=groups.dims.dp,
    )
    return RunData(hf_dir, tokenizer, train_set, val_set, sampler)


def sampling_params(cfg: RolloutConfig, step: int, greedy: bool):
    from rlstack.rollout.base import SamplingParams

    return SamplingParams(
        n=1 if greedy else cfg.n,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens,
        greedy=greedy,
        seed=cfg.seed + SEED_STRIDE * step,
    )


def replica_share(num_prompts: int, cfg: RolloutConfig, groups: ParallelGroups) -> list[int]:
    """The prompt indices this rank's rollout replica generates (world / rollout.tp replicas, contiguous)."""
    replicas, replica = groups.dims.world_size // cfg.tp, groups.rank // cfg.tp
    return split_for_rank(list(range(num_prompts)), replica, replicas)


def generate(
    engine: RolloutEngine,
    prompts: list,
    cfg: RolloutConfig,
    groups: ParallelGroups,
    step: int,
    greedy: bool,
    show_progress: bool = False,
    agent=None,
) -> tuple[list[Generation], float]:
    """Generate for `prompts` (the same list on every rank), the work split over all ranks.

    Each rollout replica (one engine, spanning rollout.tp ranks for vLLM TP) takes a contiguous share,
    so the samples do not depend on the training layout. Returns every replica's generations, with
    `prompt_index` into `prompts`, in prompt order on every rank; and the tokens generated in all.
    `agent` (an rlstack.agent.driver.AgentRollout over `engine`): each chunk goes through the agent
    driver instead (multi-turn; the Generations carry `response_mask` and the `AgentSample`).
    """
    mine = replica_share(len(prompts), cfg, groups)
    params = sampling_params(cfg, step, greedy)
    gens = []
    for chunk in progress(
        _chunks(mine, params.n, cfg),
        desc="validate" if greedy else "rollout",
        enabled=show_progress,
        rank=groups.rank,
        unit="batch",
    ):
        ids = [prompts[i].input_ids for i in chunk]
        if agent is None:
            local = engine.generate(ids, params)
        else:
            local = agent_generations(agent.generate(ids, [agent_row(prompts[i]) for i in chunk], params), params.n)
        gens += [dataclasses.replace(x, prompt_index=chunk[x.prompt_index]) for x in local]
    if groups.rank % cfg.tp:
        gens = []  # the replica's first rank reports for the whole replica
    cores = getattr(engine, "cores", None)  # the hf engine on CPU: this rank's threads lent while it waits
    with cores.waiting() if cores is not None else contextlib.nullcontext():
        gens = gather_objects(gens, groups.world, groups.dims.world_size)
    return gens, float(sum(len(x.response_ids) for x in gens))


def agent_row(prompt) -> dict:
    """A Prompt as the data row an agent loop sees (`ctx.row`; `agent_name` picks the loop)."""
    return {
        "data_source": prompt.data_source,
        "reward_model": {"ground_truth": prompt.ground_truth},
        "extra_info": prompt.extra_info,
        "agent_name": prompt.agent_name,
        "index": prompt.index,
    }


def agent_generations(samples: list, n: int) -> list[Generation]:
    """AgentSamples (n per prompt, prompt-major) as Generations carrying their mask and the sample."""
    from rlstack.rollout.base import Generation

    return [
        Generation(i // n, s.prompt_ids, s.response_ids, s.logprobs, s.finish_reason, list(s.response_mask), s)
        for i, s in enumerate(samples)
    ]


def _chunks(items: list, n: int, cfg: RolloutConfig) -> list[list]:
    """hf engine: one micro-batch of sequences per call (a progress tick each); vLLM batches all."""
    if not items:
        return []
    size = len(items) if cfg.engine == "vllm" else max(1, cfg.micro_batch_size // n)
    return [items[i : i + size] for i in range(0, len(items), size)]


def shares_prompts(cfg) -> bool:
    """Whether the update runs a prompt once for its samples (model.prefix_sharing on packed rows;
    MegatronRole.share_prefixes also needs the SDPA core attention): what a prompt's samples cost."""
    return bool(cfg.model.prefix_sharing and cfg.model.remove_padding and cfg.parallel.pp == 1)


def dp_share(
    prompts: list, gens: list[Generation], groups: ParallelGroups, balance: bool = False, shared: bool = False
) -> tuple[list, list[Generation]]:
    """This data-parallel rank's share of the prompts, and their generations (re-indexed to it).

    Contiguous, or with `balance` (trainer.balance_batch) the prompts dealt so that every rank's
    generations hold about the same number of tokens (`balanced_share`): the update's work follows
    tokens, and the ranks wait for the slowest at every gradient all-reduce. Each prompt's samples
    stay together (group advantages), and the ranks' prompt counts are those of the contiguous split.
    `shared` (`shares_prompts`): a prompt's tokens count once for its samples, as the update runs them.
    """
    if balance and groups.dims.dp > 1:
        tokens = [0] * len(prompts)
        counted: set[int] = set()
        for g in gens:
            once = shared and g.prompt_index in counted
            tokens[g.prompt_index] += (0 if once else len(g.prompt_ids)) + len(g.response_ids)
            counted.add(g.prompt_index)
        share = balanced_share(tokens, groups.dp_rank, groups.dims.dp)
    else:
        share = split_for_rank(list(range(len(prompts))), groups.dp_rank, groups.dims.dp)
    position = {p: i for i, p in enumerate(share)}
    return (
        [prompts[i] for i in share],
        [dataclasses.replace(g, prompt_index=position[g.prompt_index]) for g in gens if g.prompt_index in position],
    )


def balanced_share(tokens: list[int], rank: int, size: int) -> list[int]:
    """Rank `rank`'s items (ascending) when `size` ranks take as many items each as `split_for_rank`
    gives them and about equal token sums: items dealt largest first, each to the rank with the
    fewest tokens among those with room (ties: the lower rank). The same on every rank."""
    room = [len(split_for_rank(tokens, r, size)) for r in range(size)]
    load, owner = [0] * size, [0] * len(tokens)
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        r = min((r for r in range(size) if room[r] > 0), key=lambda r: (load[r], r))
        owner[i], room[r], load[r] = r, room[r] - 1, load[r] + tokens[i]
    return [i for i in range(len(tokens)) if owner[i] == rank]


def score(scorer, tokenizer, prompts: list, gens: list[Generation]) -> list:
    """Each response's ScoreResult (rule or custom reward) against its prompt's ground truth."""
    from rlstack.rewards import Sample

    samples = [
        Sample(
            prompts[g.prompt_index].data_source,
            tokenizer.decode(g.response_ids, skip_special_tokens=True),
            prompts[g.prompt_index].ground_truth,
            agent_extra_info(prompts[g.prompt_index].extra_info, g),
            row=prompts[g.prompt_index].index,
        )
        for g in gens
    ]
    return scorer.score_batch(samples)


def agent_extra_info(extra_info: dict, gen: Generation) -> dict:
    """The row's extra_info, with the agent loop's `extra` under "agent" for an agent sample."""
    if getattr(gen, "agent", None) is None:
        return extra_info
    from rlstack.agent.records import reward_extra_info

    return reward_extra_info(extra_info, gen.agent)


def agent_rewards(gens: list[Generation], values: list[float]) -> list[float]:
    """A loop's own reward (AgentSample.reward, when not None) replaces the scored value."""
    return [
        float(g.agent.reward) if getattr(g, "agent", None) is not None and g.agent.reward is not None else v
        for g, v in zip(gens, values)
    ]


def build_rollout(
    prompts: list,
    gens: list[Generation],
    scores: list[float],
    pad_id: int,
    micro_batch_size: int,
    device,
    on_policy: bool,
) -> Rollout:
    """The padded training batch of this rank's generations."""
    return Rollout.build(
        [prompts[g.prompt_index].input_ids for g in gens],
        [g.response_ids for g in gens],
        [g.logprobs for g in gens],
        scores,
        [g.prompt_index for g in gens],
        pad_id,
        micro_batch_size,
        device,
        on_policy,
        loss_masks=[g.response_mask for g in gens],
    )
