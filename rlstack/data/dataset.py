"""Tokenised prompt datasets for the trainer, built from files or a synthetic task.

Every prompt is tokenised (with the model's chat template) and checked against
`max_prompt_length` when the dataset is built, so a bad row stops the run before any step.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

from rlstack.data import synthetic
from rlstack.data.rows import load_rows, row_origin, validate_row
from rlstack.data.sampler import PromptSampler, val_batches  # noqa: F401  (the trainer's imports)
from rlstack.errors import UserError

logger = logging.getLogger("rlstack.data")
TRUNCATION = ("error", "drop")


@dataclass
class Prompt:
    index: int  # position of the row in the rows the dataset was built from (before drops)
    input_ids: list[int]  # chat template applied, generation prompt appended
    data_source: str
    ground_truth: str
    extra_info: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)  # the chat before the template (a reward model re-templates it)
    agent_name: str = ""  # the row's agent loop (verl's column); "": rollout.agent_loop


class PromptDataset:
    """Rows -> Prompts. truncation='error' raises on a too-long prompt; 'drop' skips and counts it."""

    def __init__(
        self,
        rows: list[dict],
        tokenizer: Any,
        max_prompt_length: int,
        truncation: str = "error",
        system_prompt: str = "",
        prompt_key: str = "prompt",
        tools: Optional[list[dict]] = None,  # tool schemas rendered into every prompt (rlstack.agent.render)
    ):
        if truncation not in TRUNCATION:
            raise UserError(f"truncation {truncation!r} is unknown: set data.truncation to error or drop")
        self.max_prompt_length = max_prompt_length
        self.num_dropped = 0
        self.prompts: list[Prompt] = []
        for index, row in enumerate(rows):
            origin = row_origin(row, index)
            row = validate_row(row, origin, prompt_key)  # rows built in code get the same checks
            messages = _messages(row[prompt_key], system_prompt)
            ids = _tokenize(tokenizer, messages, origin, tools)
            if len(ids) > max_prompt_length:
                if truncation == "error":
                    raise UserError(
                        f"{origin}: prompt is {len(ids)} tokens after the chat template, over "
                        f"data.max_prompt_length={max_prompt_length}: raise data.max_prompt_length "
                        "or set data.truncation=drop"
                    )
                self.num_dropped += 1
                continue
            self.prompts.append(
                Prompt(
                    index=index,
                    input_ids=ids,
                    data_source=row["data_source"],
                    ground_truth=str(row["reward_model"]["ground_truth"]),
                    extra_info=row["extra_info"],
                    messages=messages,
                    agent_name=str(row.get("agent_name") or ""),
                )
            )
        if rows and not self.prompts:
            raise UserError(
                f"all {len(rows)} prompts are longer than data.max_prompt_length="
                f"{max_prompt_length} tokens: raise data.max_prompt_length"
            )

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    def data_sources(self) -> list[str]:
        """Distinct data_source values (sorted): the reward scorers this dataset needs."""
        return sorted({p.data_source for p in self.prompts})


def _messages(messages: list[dict], system_prompt: str) -> list[dict]:
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _tokenize(tokenizer: Any, messages: list[dict], origin: str, tools: Optional[list[dict]] = None) -> list[int]:
    if tools:  # the template's `tools`, or a system-prompt block for a template without tool support
        from rlstack.agent.render import messages_with_tools

        messages, tools = messages_with_tools(messages, tools, tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"the model's tokenizer has no chat template (needed for {origin}): "
            "use an instruct/chat model or add a chat_template to its tokenizer_config.json"
        )
    try:
        # return_dict=False: transformers 5 returns a BatchEncoding by default, 4.x a list.
        kwargs = {"tools": tools} if tools else {}
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
    except Exception as e:  # jinja2 errors raised by the template itself (e.g. role order rules)
        raise UserError(
            f"{origin}: the model's chat template rejected the prompt ({type(e).__name__}: "
            f"{e}): fix the row's messages to suit this model's template"
        ) from e
    return [int(i) for i in ids]


# ----------------------------------------------------------------------------- building


def build_datasets(
    data_cfg: Any, tokenizer: Any, tools: Optional[list[dict]] = None
) -> tuple[PromptDataset, Optional[PromptDataset]]:
    """(train, val or None): files when data.train_files is set, else the synthetic task.
    `tools`: tool schemas rendered into every prompt (rlstack.agent.setup.prompt_tool_schemas).

    data.val_files, when set, is the val set in both cases; otherwise the synthetic task's val
    split (data.synthetic_val_size prompts; 0 means no val set).
    """
    if data_cfg.train_files:
        if data_cfg.synthetic:
            logger.warning("data.synthetic=%s has no effect: data.train_files is set", data_cfg.synthetic)
        train_rows = load_rows(data_cfg.train_files, data_cfg.prompt_key)
    elif data_cfg.synthetic:
        train_rows = _synthetic_rows(data_cfg, "train", data_cfg.synthetic_train_size)
        if not train_rows:
            raise UserError("the synthetic training set is empty: set data.synthetic_train_size >= 1")
    else:
        raise UserError("no training data: set data.train_files=[...] or data.synthetic=arith")
    if data_cfg.val_files:
        val_rows = load_rows(data_cfg.val_files, data_cfg.prompt_key)
    elif data_cfg.synthetic and not data_cfg.train_files:
        val_rows = _synthetic_rows(data_cfg, "val", data_cfg.synthetic_val_size)
    else:
        val_rows = []
    train = _build(train_rows, tokenizer, data_cfg, "train", tools)
    val = _build(val_rows, tokenizer, data_cfg, "val", tools) if val_rows else None
    return train, val


def _synthetic_rows(data_cfg: Any, split: str, n: int) -> list[dict]:
    return synthetic.make_rows(data_cfg.synthetic, n, data_cfg.seed, split, data_cfg.synthetic_max_operand)


def _build(
    rows: list[dict], tokenizer: Any, data_cfg: Any, name: str, tools: Optional[list[dict]] = None
) -> PromptDataset:
    d = data_cfg
    dataset = PromptDataset(rows, tokenizer, d.max_prompt_length, d.truncation, d.system_prompt, d.prompt_key, tools)
    if dataset.num_dropped:
        logger.warning(
            "%s set: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens",
            name,
            dataset.num_dropped,
            len(rows),
            data_cfg.max_prompt_length,
        )
    logger.info("%s set: %d prompts (%s)", name, len(dataset), ", ".join(dataset.data_sources()))
    return dataset


# ----------------------------------------------------------------------------- validation metrics


def val_accuracy(scores: list[float], data_sources: list[str]) -> dict[str, float]:
    """Share of correct responses, overall and per data_source; a score >= 1.0 counts as correct.

    Rule scorers give 1.0 for a right answer; custom scores that reward partially (e.g. a format
    bonus below 1.0) therefore never count as correct.
    """
    assert len(scores) == len(data_sources) > 0, (len(scores), len(data_sources))
    per_source: dict[str, list[bool]] = defaultdict(list)
    for score, source in zip(scores, data_sources):
        per_source[source].append(float(score) >= 1.0)
    correct = [c for flags in per_source.values() for c in flags]
    metrics = {"val/accuracy": sum(correct) / len(correct)}
    for source in sorted(per_source):
        flags = per_source[source]
        metrics[f"val/accuracy/{source}"] = sum(flags) / len(flags)
    return metrics
