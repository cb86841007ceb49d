"""Tools declared as verl declares them, duck-typed (rlstack never imports verl).

- `rollout.multi_turn.tool_config_path`: verl's YAML, `tools: [{class_name, config, tool_schema}]`.
  `class_name` is a dotted import path (`my_pkg.tools.SearchTool`, as in verl) or `FILE.py:Class`.
  The class is built as verl builds it, `cls(config=dict, tool_schema=schema)`, where `schema` has
  verl's attribute access (`schema.function.name`) and `model_dump()`; its coroutines are verl's
  `create / execute / calc_reward / release`.
- `rollout.multi_turn.function_tool_path`: a Python file of plain functions; every public function
  defined in it (or those in its `__all__`) is a tool, with the JSON schema transformers'
  `get_json_schema` reads from the signature and Google-style docstring, as verl's `@function_tool`.
  A sync function runs in a thread, an async one is awaited. It returns a str, a dict (sent as
  JSON), or (response, reward[, metrics]).

Lifecycle in a trajectory (verl's per-trajectory instances): a class tool's instance is created at
its first call with `create(create_kwargs=row.extra_info.tools_kwargs[name].create_kwargs)`, reused
by later calls, and at the trajectory's end `calc_reward(instance_id)` is recorded and
`release(instance_id)` called. (verl 0.9.1's tool_agent loop creates and releases per call and
never calls calc_reward; its older multi-turn rollout did it per trajectory, as here.)

`load_tools` is what preflight calls: a file or class that cannot load is one line naming the file
and the fix.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from rlstack.errors import UserError


class SchemaView(dict):
    """A tool schema dict with verl's pydantic access: `schema.function.name`, `model_dump()`."""

    def __getattr__(self, key: str):
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return SchemaView(value) if isinstance(value, dict) else value

    def model_dump(self, **kwargs) -> dict:
        return json.loads(json.dumps(self))


@dataclass
class ToolResult:
    text: str
    reward: Optional[float] = None  # execute's step reward
    metrics: Optional[dict] = None


class Tool:
    """One tool, whatever declared it: name, JSON schema, and the four coroutines."""

    def __init__(self, name: str, schema: dict, source: str):
        self.name = name
        self.schema = schema
        self.source = source  # the file that declared it (for messages)

    def argument_error(self, arguments: Any) -> Optional[str]:
        """Why `arguments` cannot be passed (not an object, a required parameter missing)."""
        if not isinstance(arguments, dict):
            return f"arguments of '{self.name}' must be a JSON object, got {type(arguments).__name__}"
        params = self.schema.get("function", {}).get("parameters", {}) or {}
        missing = [p for p in params.get("required", []) if p not in arguments]
        if missing:
            return f"'{self.name}' is missing required argument(s) {missing}"
        return None

    async def create(self, create_kwargs: dict) -> Optional[str]:
        return None

    async def execute(self, instance_id: Optional[str], arguments: dict) -> ToolResult:
        raise NotImplementedError

    async def calc_reward(self, instance_id: Optional[str]) -> Optional[float]:
        return None

    async def release(self, instance_id: Optional[str]) -> None:
        return None


class ClassTool(Tool):
    """A verl-style tool object (create / execute / calc_reward / release coroutines)."""

    def __init__(self, name: str, schema: dict, source: str, obj: Any):
        super().__init__(name, schema, source)
        self.obj = obj

    async def create(self, create_kwargs: dict) -> Optional[str]:
        created = await _maybe_await(self.obj.create(create_kwargs=create_kwargs))
        return created[0] if isinstance(created, tuple) else created  # verl: (instance_id, ToolResponse)

    async def execute(self, instance_id: Optional[str], arguments: dict) -> ToolResult:
        return as_tool_result(await _maybe_await(self.obj.execute(instance_id, arguments)))

    async def calc_reward(self, instance_id: Optional[str]) -> Optional[float]:
        if not hasattr(self.obj, "calc_reward"):
            return None
        value = await _maybe_await(self.obj.calc_reward(instance_id))
        return None if value is None else float(value)

    async def release(self, instance_id: Optional[str]) -> None:
        if hasattr(self.obj, "release"):
            await _maybe_await(self.obj.release(instance_id))


class FunctionTool(Tool):
    """A plain function: no lifecycle; the call binds the arguments to its signature."""

    def __init__(self, name: str, schema: dict, source: str, fn: Callable):
        super().__init__(name, schema, source)
        self.fn = fn

    def argument_error(self, arguments: Any) -> Optional[str]:
        error = super().argument_error(arguments)
        if error is None:
            try:
                inspect.signature(self.fn).bind(**arguments)
            except TypeError as e:
                return f"invalid arguments for '{self.name}': {e}"
        return error

    async def execute(self, instance_id: Optional[str], arguments: dict) -> ToolResult:
        if inspect.iscoroutinefunction(self.fn):
            return as_tool_result(await self.fn(**arguments))
        return as_tool_result(await asyncio.to_thread(self.fn, **arguments))


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def as_tool_result(value: Any) -> ToolResult:
    """verl's return shapes: a response (str, dict, an object with `.text`), or (response, reward[, metrics])."""
    if isinstance(value, tuple):
        if not 1 <= len(value) <= 3:
            raise TypeError(f"a tool returned a tuple of {len(value)}: return (response, reward[, metrics])")
        reward = None if len(value) < 2 or value[1] is None else float(value[1])
        metrics = None if len(value) < 3 or value[2] is None else dict(value[2])
        return ToolResult(_text(value[0]), reward, metrics)
    return ToolResult(_text(value))


def _text(response: Any) -> str:
    if isinstance(response, str):
        return response
    if isinstance(response, dict):
        return json.dumps(response, ensure_ascii=False)
    text = getattr(response, "text", None)  # verl's ToolResponse
    if text is not None or hasattr(response, "text"):
        return text or ""
    return str(response)


# ----------------------------------------------------------------------------- loading


def load_tools(tool_config_path: str = "", function_tool_path: str = "") -> list[Tool]:
    """The tools of both declarations; names must be unique. One-line UserErrors naming the file."""
    tools = load_tool_config(tool_config_path) if tool_config_path else []
    if function_tool_path:
        tools += load_function_tools(function_tool_path)
    seen: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in seen:
            raise UserError(
                f"tool '{tool.name}' is declared twice ({seen[tool.name].source} and {tool.source}): "
                "rename one, tool names must be unique"
            )
        seen[tool.name] = tool
    return tools


def check_tools(multi_turn) -> None:
    """Preflight: the configured tools load (rollout.multi_turn.tool_config_path / function_tool_path)."""
    load_tools(multi_turn.tool_config_path, multi_turn.function_tool_path)


def load_tool_config(path: str) -> list[Tool]:
    import yaml

    key = "rollout.multi_turn.tool_config_path"
    if not os.path.isfile(path):
        raise UserError(f"{key}={path} does not exist: point it at verl's tool YAML (tools: [{{class_name, ...}}])")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise UserError(f"{key}={path} is not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("tools"), list):
        raise UserError(f"{key}={path} has no `tools:` list: write tools: [{{class_name: ..., tool_schema: ...}}]")
    return [_config_tool(entry, i, path) for i, entry in enumerate(raw["tools"])]


def _config_tool(entry: Any, index: int, path: str) -> Tool:
    where = f"{path} tools[{index}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise UserError(f"{where} has no class_name: give each tool class_name, config and tool_schema")
    config = entry.get("config") or {}
    cls = _import_class(entry["class_name"], where)
    schema = entry.get("tool_schema")
    if schema is not None:  # checked before the class sees it: verl's BaseTool reads schema.function.name
        _check_schema_name(schema, entry["class_name"], where)
    try:
        obj = cls(config=config, tool_schema=SchemaView(schema) if isinstance(schema, dict) else None)
    except Exception as e:
        raise UserError(
            f"{where}: {entry['class_name']}(config=..., tool_schema=...) raised {type(e).__name__}: "
            f"{_first_line(e)}: fix the tool's constructor or its config"
        ) from e
    if schema is None:
        schema = getattr(obj, "tool_schema", None)
        schema = schema.model_dump() if hasattr(schema, "model_dump") else schema
    name = _check_schema_name(schema, entry["class_name"], where)
    for method in ("create", "execute", "release"):
        if not callable(getattr(obj, method, None)):
            raise UserError(f"{where}: {entry['class_name']} has no {method}(): implement verl's tool methods")
    return ClassTool(name, dict(schema), path, obj)


def _check_schema_name(schema: Any, class_name: str, where: str) -> str:
    function = schema.get("function") if isinstance(schema, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise UserError(
            f"{where}: the tool_schema of {class_name} has no function.name: write "
            "tool_schema: {type: function, function: {name: ..., description: ..., parameters: ...}}"
        )
    return name


def _import_class(class_name: str, where: str):
    if ".py:" in class_name:
        path, _, attr = class_name.rpartition(":")
        module = import_file(path, where)
    else:
        module_name, _, attr = class_name.rpartition(".")
        if not module_name:
            raise UserError(f"{where}: class_name {class_name!r} needs its module: write package.module.Class")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise UserError(
                f"{where}: cannot import module {module_name!r} for {class_name} ({type(e).__name__}: "
                f"{_first_line(e)}): install it, put it on PYTHONPATH, or write class_name: FILE.py:Class"
            ) from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise UserError(f"{where}: {class_name} is not a class in {module.__name__}: fix class_name")
    return cls


def import_file(path: str, where: str):
    """Import a user's Python file as a module (once per path); one-line errors."""
    abs_path = os.path.abspath(path)
    if not os.path.isfile(abs_path):
        raise UserError(f"{where}: {path} does not exist: fix the path (relative to {os.getcwd()})")
    name = "rlstack_user_" + abs_path.replace(os.sep, "_").replace(".", "_").replace("-", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, abs_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UserError(f"{where}: importing {path} raised {type(e).__name__}: {_first_line(e)}: fix the file") from e
    return module


def load_function_tools(path: str) -> list[Tool]:
    where = f"rollout.multi_turn.function_tool_path={path}"
    module = import_file(path, where)
    names = getattr(module, "__all__", None) or [
        n
        for n, fn in vars(module).items()
        if inspect.isfunction(fn) and not n.startswith("_") and fn.__module__ == module.__name__
    ]
    tools = []
    for n in names:
        fn = getattr(module, n, None)
        if not callable(fn):
            raise UserError(f"{where}: __all__ names {n!r}, which is not a function in the file: fix __all__")
        tools.append(FunctionTool(n, function_schema(fn, where), path, fn))
    if not tools:
        raise UserError(
            f"{where} defines no public function: write def calculator(expression: str) -> str with a docstring"
        )
    return tools


def function_schema(fn: Callable, where: str) -> dict:
    """transformers' get_json_schema (verl's @function_tool), with a one-line fix on failure."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as e:
        raise UserError(
            f"{where}: no tool schema for {fn.__name__}() ({_first_line(e)}): give it a type hint per "
            "parameter and a Google-style docstring with an Args: line per parameter"
        ) from None
    schema["function"].pop("return", None)  # verl's OpenAIFunctionSchema keeps name, description, parameters
    return schema


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
