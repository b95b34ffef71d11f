"""The seed's QA agent, now really calling its LLM, with its system prompt optimized by APO.

The agent is the seed article's ``QAAgent`` (see ``examples/seed_qa_agent.py``) with the
placeholder replaced: it calls the ``llm`` resource with the ``openai`` client - whose
``base_url`` the server points at the per-attempt gateway, so every call is recorded - and
scores the answer against the gold answer: 1.0 for a correct, short answer, 0.5 for a correct
answer buried in a long one, 0 otherwise. :class:`~agentbolt.algorithms.apo.APO` reads the
recorded runs, asks an optimizer model for a critique and a rewrite of ``system_prompt``, and
keeps the rewrites that score better on held-out questions.

Which model:

* by default, offline: the embedded SmolLM2-135M-Instruct (``agentbolt model pull`` once), served
  by the in-process engine; it answers the questions *and* acts as the optimizer;
* with ``OPENAI_API_KEY`` (and optionally ``OPENAI_BASE_URL``, ``OPENAI_MODEL``) set: that
  endpoint for both roles - any OpenAI-compatible server (OpenAI, vLLM, llama.cpp, Ollama).

What to expect offline. A 135M-parameter model is a poor prompt engineer, and slow on a CPU.
Measured on a shared 2-core machine under heavy load (under 1 token/s; DESIGN.md measured
about 20 on an idle one): one critique took 279 s and, instead of critiquing, went on listing
runs in the format it was shown; the rewrite we waited for ran its full 160 tokens - the old
prompt, a closing ``</prompt>``, then unrelated text - so it came back as the old prompt and
was rejected as a duplicate. Expect most rewrites to be rejected and counted in
``result.stats``, and the seed prompt to come back: the never-worse-than-the-seed rule at work.
Offline, this example shows the machinery end to end (server, runners, gateway records,
optimizer calls, versions); point it at a capable model to see prompts improve, or use the
``bootstrap`` method (``agentbolt train apo --method bootstrap``, the default), which needs no
optimizer model: it gains offline (docs/training.md).

Run: ``python examples/apo_qa.py [--rounds 2]``. To export the best prompt afterwards, serve the
run's store (``agentbolt server --db runs/<time>/agentbolt.db``) and run
``agentbolt export prompt --version best --out prompt.txt``.
"""

from __future__ import annotations

import argparse
import os
import re
from contextlib import ExitStack
from typing import Any

from openai import OpenAI

from agentbolt import LLM, LitAgent, PromptTemplate, Task, Trainer, Trajectory
from agentbolt.algorithms.apo import APO, APOResult


class QAAgent(LitAgent):
    """Answers a question with one LLM call; the reward compares the answer with the gold one."""

    def execute_rollout(self, task: Task) -> Trajectory:
        system_prompt = self.get_resource("system_prompt")
        llm: LLM = self.get_resource("llm")
        client = OpenAI(base_url=llm.base_url, api_key=llm.api_key or "none", timeout=300, max_retries=1)
        response = client.chat.completions.create(
            model=llm.model,
            messages=[
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": task.data["user_input"]},
            ],
            max_tokens=32,
            temperature=0.0,
        )
        answer = response.choices[0].message.content or ""
        reward = self.evaluate_response(answer, task.data["gold_answer"])
        return Trajectory(
            task_id=task.id,
            final_response=answer,
            total_reward=reward,
            trace=[{"step": 1, "action": "LLM Call", "input_prompt": system_prompt}],
        )

    def evaluate_response(self, response: str, gold_answer: str) -> float:
        """1.0: the gold answer (or an alias, ``|``-separated) in at most 8 words; 0.5: in more."""
        words = _words(response)
        text = f" {' '.join(words)} "
        if not any(f" {' '.join(_words(alias))} " in text for alias in gold_answer.split("|")):
            return 0.0
        return 1.0 if len(words) <= 8 else 0.5


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


QA_TASKS = [
    {"id": "capital-fr", "user_input": "What is the capital of France?", "gold_answer": "Paris"},
    {"id": "h2o", "user_input": "What is the chemical formula of water?", "gold_answer": "H2O"},
    {"id": "legs", "user_input": "How many legs does a spider have?", "gold_answer": "8|eight"},
    {
        "id": "planet",
        "user_input": "Which planet is the largest in our solar system?",
        "gold_answer": "Jupiter",
    },
    {"id": "sky", "user_input": "What color is the sky on a clear day?", "gold_answer": "blue"},
    {"id": "romeo", "user_input": "Who wrote Romeo and Juliet?", "gold_answer": "Shakespeare"},
    {"id": "capital-jp", "user_input": "What is the capital of Japan?", "gold_answer": "Tokyo"},
    {"id": "week", "user_input": "How many days are in a week?", "gold_answer": "7|seven"},
    {"id": "hot", "user_input": "What is the opposite of hot?", "gold_answer": "cold"},
    {"id": "freeze", "user_input": "At how many degrees Celsius does water freeze?", "gold_answer": "0|zero"},
    {
        "id": "president",
        "user_input": "Who was the first president of the United States?",
        "gold_answer": "Washington",
    },
    {"id": "capital-it", "user_input": "What is the capital of Italy?", "gold_answer": "Rome"},
]
SEED_PROMPT = "You are a helpful assistant."


def _remote_llm() -> LLM | None:
    """The endpoint named by the OpenAI environment variables, if any."""
    if not (os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_KEY")):
        return None
    return LLM(
        base_url=os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1"),
        model=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"),
        api_key=os.environ.get("OPENAI_API_KEY"),
    )


def _embedded_llm(stack: ExitStack, model: str) -> LLM:
    """Load the local model and serve it on 127.0.0.1 until ``stack`` closes."""
    from agentbolt.engine import EngineServer, ModelEngine

    engine = ModelEngine.from_pretrained(model)
    server = stack.enter_context(EngineServer(engine))
    return LLM(base_url=server.base_url, model=engine.name)


def main(model: str = "smollm2", rounds: int = 2, n_runners: int = 1, **apo: Any) -> APOResult:
    """Optimize the QA agent's prompt; ``apo`` overrides :class:`APO` settings."""
    with ExitStack() as stack:
        llm = _remote_llm() or _embedded_llm(stack, model)
        settings: dict[str, Any] = dict(
            method="rewrite",  # the seed's APO: an optimizer model rewrites the prompt
            rounds=rounds,
            beam_width=1,
            branch_factor=2,
            train_batch_size=3,
            max_examples=3,
            max_example_chars=600,
            optimizer_max_tokens=160,
            optimizer_retries=1,
            optimizer_timeout=600.0,
        )
        trainer = Trainer(
            algorithm=APO(**{**settings, **apo}),
            n_runners=n_runners,
            runner_concurrency=4,
            resources={"system_prompt": PromptTemplate(template=SEED_PROMPT), "llm": llm},
        )
        result: APOResult = trainer.fit(QAAgent(), train_tasks=QA_TASKS[:6], val_tasks=QA_TASKS[6:10])

    def score(value: float | None) -> str:  # None: no validation run was scored
        return f"{value:.3f}" if value is not None else "-"

    print(
        f"APO: seed val {score(result.seed_val)} -> best val {score(result.best_val)}; stats {result.stats.as_dict()}"
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--model", default="smollm2", help="embedded model: 'smollm2' or a local HF directory"
    )
    args = parser.parse_args()
    main(model=args.model, rounds=args.rounds)
