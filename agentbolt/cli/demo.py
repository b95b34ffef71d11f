"""The main job: ``agentbolt demo`` trains SmolLM2-135M-Instruct with GRPO on a tool-using agent.

The agent is ordinary code with the plain ``openai`` client: it asks the model an arithmetic
question; the model must call the calculator tool (``CALC: <expression>``), read the tool's
``RESULT`` and answer ``ANSWER: <number>``. SmolLM2-135M cannot do two-digit arithmetic itself,
so success depends on learning to use the tool. One worked episode in the prompt (chat turns)
makes the untrained model succeed sometimes — RL needs that spread to learn anything.

Reward (tied to real progress, so it cannot be gamed by format alone): 1.0 for the right answer
in the required format; 0.2 when the tool was called with exactly the question's expression but
the final answer was wrong or missing; else 0.
"""

from __future__ import annotations

import ast
import operator
import random
import re
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from agentbolt.extras import needs_extra
from agentbolt.runner.agent import LitAgent, emit_tool_call
from agentbolt.runner.llm import async_openai
from agentbolt.schemas import LLM, PromptTemplate, Task

__all__ = ["CalculatorAgent", "calculator", "demo_command", "make_tasks", "score"]

SYSTEM_PROMPT = (
    "You are a careful assistant with a calculator tool. To use it, reply with one line "
    "'CALC: <expression>'. After the RESULT comes back, reply with one line 'ANSWER: <number>'."
)
WORKED_EPISODE = [
    {"role": "user", "content": "What is 23 * 41?"},
    {"role": "assistant", "content": "CALC: 23 * 41"},
    {"role": "user", "content": "RESULT: 943"},
    {"role": "assistant", "content": "ANSWER: 943"},
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_CALC = re.compile(r"CALC:\s*([0-9+\-*\s()]+)")
_ANSWER = re.compile(r"ANSWER:\s*(-?\d+)")


def calculator(expression: str) -> int:
    """Evaluate + - * over integers (no names, no calls); raises ValueError otherwise."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return int(_OPS[type(node.op)](ev(node.left), ev(node.right)))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    if len(expression) > 64:
        raise ValueError("expression too long")
    try:
        return ev(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {expression!r}") from exc


def make_tasks(n: int, seed: int) -> list[Task]:
    """``n`` two-digit arithmetic questions, reproducible from ``seed``."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-*")
        expr = f"{a} {op} {b}"
        data = {"question": f"What is {expr}?", "expression": expr, "answer": calculator(expr)}
        tasks.append(Task(id=f"calc-{seed}-{i}", data=data))
    return tasks


def _norm(expr: str) -> str:
    return re.sub(r"\s+", "", expr)


def score(task_data: dict[str, Any], replies: list[str]) -> float:
    """The reward for one episode, from the model's replies in order (see the module doc)."""
    answers = [m.group(1) for r in replies if (m := _ANSWER.search(r))]
    if answers and int(answers[-1]) == task_data["answer"] and len(replies) <= 2:
        return 1.0
    calls = [_norm(m.group(1)) for r in replies[:1] if (m := _CALC.search(r))]
    return 0.2 if calls and calls[0] == _norm(task_data["expression"]) else 0.0


class CalculatorAgent(LitAgent):
    """A two-turn tool-using agent over any OpenAI-compatible endpoint (the ``llm`` resource)."""

    max_tokens = 24

    async def execute_rollout(self, task: Task) -> float:  # type: ignore[override]
        llm: LLM = self.get_resource("llm")
        prompt = self.get_resource("system_prompt")
        client = async_openai(llm, timeout=600)
        messages = [
            {"role": "system", "content": prompt},
            *WORKED_EPISODE,
            {"role": "user", "content": task.data["question"]},
        ]
        replies: list[str] = []
        for _turn in range(2):
            reply = await self._ask(client, llm, messages)
            replies.append(reply)
            messages.append({"role": "assistant", "content": reply})
            call = _CALC.search(reply)
            if call is None or _turn == 1:
                break
            messages.append({"role": "user", "content": f"RESULT: {self._tool(call.group(1))}"})
        return score(task.data, replies)

    async def _ask(self, client: Any, llm: LLM, messages: list[dict[str, str]]) -> str:
        params = {"temperature": 1.0, **llm.sampling_parameters}
        response = await client.chat.completions.create(
            model=llm.model, messages=messages, max_tokens=self.max_tokens, **params
        )
        return (response.choices[0].message.content or "").strip()

    @staticmethod
    def _tool(expression: str) -> str:
        t0 = time.perf_counter()
        try:
            result: Any = calculator(expression)
            error = None
        except ValueError as exc:
            result, error = "error", str(exc)
        emit_tool_call(
            "calculator",
            {"expression": expression},
            result=result,
            error=error,
            duration_ms=(time.perf_counter() - t0) * 1000,
        )
        return str(result)


@needs_extra("agentbolt demo", "server", "train")
def demo_command(
    steps: Annotated[int, typer.Option(help="GRPO steps.")] = 8,
    group_size: Annotated[int, typer.Option(help="Rollouts per task per step.")] = 8,
    tasks_per_step: Annotated[int, typer.Option(help="Tasks per step.")] = 4,
    val_tasks: Annotated[int, typer.Option(help="Held-out tasks for the before/after evaluation.")] = 96,
    model: Annotated[
        str, typer.Option(help="'smollm2' or a local Hugging Face model directory.")
    ] = "smollm2",
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 3e-4,
    run_dir: Annotated[Path | None, typer.Option(help="Where metrics, checkpoints and the plot go.")] = None,
    resume: Annotated[bool, typer.Option(help="Continue from the run directory's checkpoint.")] = False,
    concurrency: Annotated[int, typer.Option(help="Rollouts in flight (the engine batches them).")] = 32,
) -> None:
    """Train SmolLM2-135M with GRPO to use a calculator tool; prints before/after and a plot."""
    from agentbolt.algorithms.grpo import GRPO
    from agentbolt.console import make_console, print_line
    from agentbolt.trainer import Trainer

    console = make_console()
    run_dir = run_dir or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    algo = GRPO(
        model=model,
        steps=steps,
        group_size=group_size,
        tasks_per_step=tasks_per_step,
        lr=lr,
        resume=resume,
        val_every=0,
        checkpoint_every=max(1, steps // 2),
    )
    trainer = Trainer(
        algo,
        n_runners=1,
        runner_concurrency=concurrency,
        run_dir=run_dir,
        console=console,
        resources={"system_prompt": PromptTemplate(template=SYSTEM_PROMPT, engine="plain")},
    )
    # Said first: the untrained model's validation comes before the first step's line.
    print_line(
        console,
        f"agentbolt demo: GRPO on {model}, {steps} steps of {tasks_per_step} tasks x {group_size} "
        f"rollouts; held-out success on {val_tasks} tasks before and after; run folder {run_dir}",
    )
    t0 = time.perf_counter()
    result = trainer.fit(CalculatorAgent(), make_tasks(256, seed=1), make_tasks(val_tasks, seed=2))
    console.print()  # the live training display ends without a line break
    _report(console, result, steps, val_tasks, time.perf_counter() - t0)
    console.print(f"plot: {result.plot}   metrics: {result.metrics_file}   run: {run_dir}")


def _report(console: Console, result: Any, steps: int, val_tasks: int, seconds: float) -> None:
    """The held-out success before and after training, and the change."""
    table = Table(title=f"held-out success ({val_tasks} tasks, strict: right answer in the required format)")
    table.add_column("model")
    table.add_column("success", justify="right")
    before, after = result.val_before or 0.0, result.val_after or 0.0
    table.add_row("untrained SmolLM2-135M-Instruct", f"{before:.0%}")
    table.add_row(f"after {steps} GRPO steps", f"{after:.0%}")
    console.print(table)
    console.print(f"change: {100 * (after - before):+.0f} percentage points in {seconds:.0f} s")
