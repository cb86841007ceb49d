"""Chat-template rendering as ids: prompts with tool schemas, and the turns a loop inserts.

An inserted turn (tool results, a user's feedback) is rendered once, as ids, and appended after
the policy's own ids: never decoded and re-tokenized. Its ids are the template's rendering of the
new messages after a fixed synthetic history (`_SYNTHETIC`), the suffix diff verl's
ContinuousTokenBuilder takes (verl/utils/tokenizer/continuous_token.py), so they do not depend on
what the trajectory said. Before them comes the rest of the policy's turn end: the template's ids
after the eos that ends an assistant message (ChatML: "\\n" after <|im_end|>), or, when the policy
stopped without eos (its per-turn cap), the eos too.

Tool schemas reach the model through the template's `tools` argument when the template uses it
(Qwen2/2.5/3, Llama 3.1), else through a system-prompt block in the Hermes format that
Qwen2.5's template writes (`TOOLS_SYSTEM_PROMPT`; SmolLM2's ChatML template has no tool support),
with tool results then sent back as a user turn of `<tool_response>` blocks, again as Qwen2.5 does.
"""

from __future__ import annotations

import json
from typing import Any, Optional

_SYNTHETIC = [
    {"role": "system", "content": "synthetic system"},
    {"role": "user", "content": "synthetic user"},
]
_SYNTHETIC_REPLY = "synthetic reply"

TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_supports_tools(tokenizer: Any) -> bool:
    """The chat template reads a `tools` variable (else schemas go into the system prompt)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: the default one renders
        template = template.get("default", "") or ""
    return "tools" in template


def tools_system_text(schemas: list[dict]) -> str:
    """The Hermes tool block for a template without tool support (one JSON schema per line)."""
    return TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in schemas))


def messages_with_tools(messages: list[dict], schemas: list[dict], tokenizer: Any) -> tuple[list[dict], Optional[list]]:
    """(messages, tools argument) to render a prompt with: the template's own tool support, or the
    tool block appended to the system message (one added when there is none)."""
    if not schemas:
        return messages, None
    if template_supports_tools(tokenizer):
        return messages, schemas
    block = tools_system_text(schemas)
    messages = [dict(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{block}" if messages[0]["content"] else block
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages, None


def apply_template(tokenizer: Any, messages: list[dict], tools: Optional[list] = None, generation: bool = True):
    """apply_chat_template as a list of ints (transformers 5 returns a BatchEncoding unless return_dict=False)."""
    kwargs = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation, tokenize=True, return_dict=False, **kwargs
    )
    return [int(i) for i in ids]


class TurnRenderer:
    """Ids to append after a policy turn for new messages (tool results, user turns).

    Computed from the template once per message shape; `schemas` are the tools the prompt was
    rendered with (their rendering in the synthetic history keeps the diff aligned)."""

    def __init__(self, tokenizer: Any, eos_token_id: int, schemas: Optional[list[dict]] = None):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.native_tools = bool(schemas) and template_supports_tools(tokenizer)
        self.tools = schemas if self.native_tools else None
        self.turn_tail = self._turn_tail()

    def _turn_tail(self) -> list[int]:
        """The template's ids after the eos that ends an assistant message ([] when eos is last)."""
        full = apply_template(
            self.tokenizer, _SYNTHETIC + [{"role": "assistant", "content": _SYNTHETIC_REPLY}], self.tools, False
        )
        if self.eos_token_id not in full:
            return []
        last = len(full) - 1 - full[::-1].index(self.eos_token_id)
        return full[last + 1 :]

    def close_turn(self, generated: list[int]) -> list[int]:
        """What ends the policy's turn: the tail after its eos, or eos + tail when it stopped without one."""
        if generated and generated[-1] == self.eos_token_id:
            return list(self.turn_tail)
        return [self.eos_token_id] + self.turn_tail if self.eos_token_id >= 0 else list(self.turn_tail)

    def messages_ids(self, messages: list[dict], tool_calls: Optional[list[dict]] = None) -> list[int]:
        """The ids of `messages` after an assistant turn, ending with the generation prompt."""
        assistant: dict = {"role": "assistant", "content": _SYNTHETIC_REPLY}
        if tool_calls and self.native_tools:
            assistant["tool_calls"] = tool_calls
        prefix = _SYNTHETIC + [assistant]
        head = apply_template(self.tokenizer, prefix, self.tools, generation=False)
        full = apply_template(self.tokenizer, prefix + list(messages), self.tools, generation=True)
        if full[: len(head)] != head:
            roles = ", ".join(m["role"] for m in messages)
            raise ValueError(f"the chat template renders the history differently once {roles} messages follow")
        return full[len(head) :]

    def after_turn(self, generated: list[int], messages: list[dict], tool_calls: Optional[list[dict]] = None):
        """close_turn + messages_ids: everything a loop inserts between two policy turns."""
        return self.close_turn(generated) + self.messages_ids(messages, tool_calls)

    def tool_messages(self, results: list[tuple[str, str]]) -> list[dict]:
        """(tool name, result text) pairs -> the messages that carry them: `tool` messages for a
        template with tool support, else one user turn of Hermes `<tool_response>` blocks."""
        if self.native_tools:
            return [{"role": "tool", "name": name, "content": text} for name, text in results]
        blocks = "\n".join(f"<tool_response>\n{text}\n</tool_response>" for _, text in results)
        return [{"role": "user", "content": blocks}]
