"""A function tool for `rollout.multi_turn.function_tool_path` (yaml_configs/smollm2_arith_tools_cpu.yaml).

Every public function of this file is a tool; its JSON schema comes from the type hints and the
Google-style docstring (transformers' get_json_schema, as verl's @function_tool).
"""

import ast
import operator

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: The expression to evaluate, e.g. "12 + 7 * 3".
    """
    value = _eval(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else str(value)


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression element: {ast.dump(node)[:40]}")
