"""Built-in tools: a calculator (safe evaluation of arithmetic, no `eval`) and a Python executor (the sandbox).

A tool is a function `(arguments: dict, context: ToolContext) -> str` plus the JSON schema a chat template
receives (`tools=[...]` of `apply_chat_template`). Whatever the model sends, a tool answers one string: its
result, or `error: ...` on one line (`is_error` recognizes it).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .sandbox import SandboxLimits, run_python

ERROR_PREFIX = "error: "


@dataclass
class ToolContext:
    """What the loop hands tools: the sandbox's limits and the paths it must hide (the run dir, its parent)."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    hide: list[Path] = field(default_factory=list)
    require_isolation: bool = True


def error(msg: str) -> str:
    """A tool's one-line error observation."""
    return ERROR_PREFIX + " ".join(str(msg).split())[:300]


def is_error(observation: str) -> bool:
    return observation.startswith(ERROR_PREFIX)


# --------------------------------------------------------------------------- calculator

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "log": math.log, "exp": math.exp}
_CONSTS = {"pi": math.pi, "e": math.e}
MAX_EXPR_CHARS = 200
MAX_POW_EXPONENT = 64
MAX_ABS = 1e100


def calculate(expression: str) -> float | int:
    """Evaluate +-*/ // % ** with numbers, parentheses, pi, e and sqrt/abs/round/min/max/log/exp; ValueError
    naming what is not allowed."""
    if len(expression) > MAX_EXPR_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > MAX_POW_EXPONENT:
            raise ValueError(f"exponent {b} is larger than {MAX_POW_EXPONENT}")
        out = _BINOPS[type(node.op)](a, b)
        if abs(out) > MAX_ABS:
            raise ValueError("result too large")
        return out
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
            and not node.keywords and len(node.args) <= 4):
        return _FUNCS[node.func.id](*[_eval(a) for a in node.args])
    raise ValueError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and "
                     f"{', '.join(sorted(_FUNCS))}")


def calculator_tool(arguments: dict, context: ToolContext) -> str:
    expr = arguments.get("expression")
    if not isinstance(expr, str):
        return error("calculator: send {\"expression\": \"...\"}")
    try:
        value = calculate(expr)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return error(f"calculator: {e}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


# --------------------------------------------------------------------------- python

def python_tool(arguments: dict, context: ToolContext) -> str:
    """Run the code in the sandbox; stdout+stderr, or a one-line error (the exception's last line, a limit)."""
    code = arguments.get("code")
    if not isinstance(code, str) or not code.strip():
        return error("python: send {\"code\": \"...\"}")
    r = run_python(code, context.limits, context.hide, context.require_isolation)
    lim = context.limits
    if r.killed == "wall time":
        return error(f"python: wall time limit of {lim.wall_s:g}s exceeded")
    if r.killed == "output limit":
        return error(f"python: output exceeded {lim.output_bytes} bytes")
    if r.killed == "sandbox setup":  # the machine's fault, not the model's: the reason is logged once per start
        return error("python: the sandbox could not be set up")
    if r.exit_code == 124 and "CPU time limit exceeded" in r.output:
        return error(f"python: CPU time limit of {lim.cpu_s}s exceeded")
    if r.exit_code != 0:
        lines = [x.strip() for x in r.output.strip().splitlines() if x.strip()]
        if r.exit_code is not None and r.exit_code < 0:
            return error(f"python: killed by signal {-r.exit_code}" + (f" ({lines[-1]})" if lines else ""))
        return error(f"python: {_error_line(lines) if lines else f'exit code {r.exit_code}'}")
    return r.output.strip() or "(no output; print the result)"


# An exception's last line ("BlockingIOError: [Errno 11] ...", "KeyboardInterrupt").
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)(:|$)")


def _error_line(lines: list[str]) -> str:
    """The line that says what went wrong: the last exception line (the processes of a call may interleave their
    tracebacks, so the output's last line can be another traceback's start), else the last line."""
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line
    return lines[-1]


# --------------------------------------------------------------------------- registry

def _schema(name: str, description: str, param: str, param_desc: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {param: {"type": "string", "description": param_desc}},
                       "required": [param]}}}


TOOLS: dict[str, tuple[Callable[[dict, ToolContext], str], dict]] = {
    "calculator": (calculator_tool, _schema("calculator", "Evaluate an arithmetic expression.", "expression",
                                            "e.g. (3 + 4) * 12 / 5")),
    "python": (python_tool, _schema("python", "Run Python code in a sandbox and return what it prints.", "code",
                                    "a Python script; print the result")),
}


def tool_schemas(names: list[str]) -> list[dict]:
    return [TOOLS[n][1] for n in names]
