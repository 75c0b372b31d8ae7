"""The runtime's shape, held: what is not about tensors lives in the engine-neutral session and
step planner (torch-free, so both runtimes and their tests share them), the vLLM proposer keeps
only tensors and its engine's lifecycle, and no runtime function grows past what a reader
takes in at once."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

RUNTIME = Path(__file__).parents[2] / "kapc" / "runtime"
PROPOSER_LINES = 410
FUNCTION_BODY_LINES = 60  # statements after the signature and docstring


def test_session_and_planner_need_no_torch():
    code = (
        "import sys\n"
        "import kapc.runtime.session, kapc.runtime.planner\n"
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_proposer_keeps_only_tensors_and_its_engine():
    lines = len((RUNTIME / "vllm" / "proposer.py").read_text().splitlines())
    assert lines <= PROPOSER_LINES, f"proposer.py has {lines} lines"


def test_no_runtime_function_is_longer_than_a_screen():
    long = []
    for path in sorted(RUNTIME.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            if not body:
                continue
            size = body[-1].end_lineno - body[0].lineno + 1
            if size > FUNCTION_BODY_LINES:
                long.append(f"{path.relative_to(RUNTIME)}:{node.lineno} {node.name}: {size}")
    assert not long, long
