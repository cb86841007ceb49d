"""The public API of an agent loop: `AgentLoop`, `AgentOutput`, and what a loop's `ctx` offers.

A loop turns one prompt (token ids, chat template applied) into one sample: it calls
`await ctx.generate(token_ids)` as often as it likes, appends what the policy generated and what it
inserts itself (tool results, environment or user turns, rendered once as ids with
`ctx.renderer`), and returns an `AgentOutput`. Nothing is decoded and re-tokenized between turns:
the ids the trainer trains on are exactly the engine's ids and the inserted ids (verl #6719 and
NeMo-RL #2822 are the corruptions re-tokenizing causes). `Transcript` keeps the three parallel lists.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from rlstack.agent.render import TurnRenderer
    from rlstack.rollout.base import SamplingParams


@dataclass
class AgentOutput:
    """One sample. `response_ids` is everything after the prompt; `response_mask[i]` is 1 where the
    policy generated token i and 0 where the loop inserted it; `logprobs` has one value per response
    token (ignored where the mask is 0); `reward`, when not None, is the sample's score instead of the
    reward function's; `extra` is logged and reaches the reward function as `extra_info["agent"]`.
    A loop may set `extra["finish_reason"]` to say why it stopped (else: the last turn's)."""

    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    reward: Optional[float] = None
    num_turns: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TurnOutput:
    """What `ctx.generate` returns: the policy's new ids, their log-probs (one each, the engines'
    convention: of softmax(logits / temperature)), and "stop" (eos, included) or "length"."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class AgentLoop(ABC):
    """Subclass and implement `run`. A user loop is named `FILE.py:ClassName` in
    `rollout.agent_loop` (or a row's `agent_name`) and built with no arguments, once per run."""

    @abstractmethod
    async def run(self, prompt_ids: list[int], ctx: AgentContext) -> AgentOutput:
        """One trajectory from `prompt_ids`; `ctx` is this trajectory's handle on the engine."""


class AgentContext:
    """A trajectory's view of the rollout: the batched engine, its row and its budget.

    `generate(token_ids)` takes the whole context (prompt + response so far) and is capped by what
    is left of `max_response_tokens` (the budget of all turns, model and inserted tokens together);
    past the budget it returns no tokens with finish_reason "length" without calling the engine.
    """

    def __init__(
        self,
        batcher,
        index: int,
        prompt_ids: list[int],
        row: dict,
        sampling: SamplingParams,
        max_response_tokens: int,
        tokenizer: Any,
        renderer: Optional[TurnRenderer] = None,
    ):
        self._batcher = batcher
        self.index = index  # the sample's position in the driver's batch
        self.prompt_len = len(prompt_ids)
        self.row = row
        self.sampling = sampling
        self.max_response_tokens = max_response_tokens
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.num_generate_calls = 0
        self.last_finish_reason = "stop"

    def remaining(self, token_ids: list[int]) -> int:
        """Tokens of the budget left after `token_ids` (the prompt and the response so far)."""
        return self.max_response_tokens - (len(token_ids) - self.prompt_len)

    async def generate(self, token_ids: list[int], max_new_tokens: Optional[int] = None) -> TurnOutput:
        cap = self.remaining(token_ids)
        if max_new_tokens is not None:
            cap = min(cap, int(max_new_tokens))
        self.num_generate_calls += 1
        if cap < 1:
            out = TurnOutput([], [], "length")
        else:
            out = await self._batcher.generate(self.index, list(token_ids), cap)
        self.last_finish_reason = out.finish_reason
        return out


class Transcript:
    """The response being built: ids, mask (1 = policy) and log-probs (0.0 where inserted), in step."""

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.logprobs: list[float] = []

    @property
    def context(self) -> list[int]:
        """What the next `ctx.generate` continues: the prompt and the response so far."""
        return self.prompt_ids + self.response_ids

    def add_generated(self, out: TurnOutput) -> None:
        assert len(out.token_ids) == len(out.logprobs), (len(out.token_ids), len(out.logprobs))
        self.response_ids += out.token_ids
        self.response_mask += [1] * len(out.token_ids)
        self.logprobs += out.logprobs

    def add_inserted(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def __len__(self) -> int:
        return len(self.response_ids)

    def output(self, **kwargs) -> AgentOutput:
        return AgentOutput(list(self.response_ids), list(self.response_mask), list(self.logprobs), **kwargs)
