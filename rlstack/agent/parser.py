"""Tool calls in the Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Unlike verl's HermesToolParser, which drops a block it cannot decode, a malformed block is kept as a
call with an `error`: the loop answers it with the error text, so the model learns the format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FORMATS = ("hermes",)


@dataclass
class ParsedCall:
    name: str  # "" when the block has none
    arguments: Any  # the decoded "arguments" (a dict when well-formed)
    error: Optional[str] = None  # why the block is not a call (then `name`/`arguments` may be empty)

    def as_message_call(self) -> dict:
        """The OpenAI-style tool call a chat template renders in an assistant message."""
        args = self.arguments if isinstance(self.arguments, dict) else {}
        return {"type": "function", "function": {"name": self.name, "arguments": args}}


def parse_hermes(text: str) -> list[ParsedCall]:
    """Every `<tool_call>` block of `text`, in order; an unclosed block counts as malformed."""
    calls = [_parse_block(block) for block in TOOL_CALL_RE.findall(text)]
    tail = TOOL_CALL_RE.sub("", text)
    if "<tool_call>" in tail:
        calls.append(ParsedCall("", None, "malformed tool call: <tool_call> without </tool_call>"))
    return calls


def _parse_block(block: str) -> ParsedCall:
    try:
        call = json.loads(block)
    except json.JSONDecodeError as e:
        return ParsedCall("", None, f"malformed tool call: invalid JSON ({e.msg} at char {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return ParsedCall("", None, 'malformed tool call: write {"name": "<tool>", "arguments": {...}}')
    arguments = call["arguments"]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return ParsedCall(call["name"], arguments)
