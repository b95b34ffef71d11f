"""DSPy's side of the prompt-optimization benchmark (issue 39, item 4): DSPy's own
``BootstrapFewShotWithRandomSearch`` on the tasks, splits, scorer and rollout budget that
agentbolt's bootstrap APO gets, against the same embedded model.

Runs in DSPy's own virtualenv (``benchmarks/dspy_env.sh`` makes ``.venv-dspy``) and imports no
agentbolt; the main benchmark (``benchmarks/apo_vs_dspy.py``) draws the tasks, serves the model
and calls it:

    .venv-dspy/bin/python benchmarks/apo_dspy_side.py --tasks TASKS.json \\
        --base-url http://127.0.0.1:8001/v1 --budget 200 --seed 1 --json OUT.json

``--tasks``: a JSON object ``{"spec": "reasoning_gym:<dataset>?..." or "calculator", "dataset":
"<dataset>", "train": [data, ...], "val": [data, ...], "heldout": [data, ...]}``, where each
``data`` is a task's data as agentbolt makes it (``Task.data``). For a reasoning-gym spec
(``dataset``, ``options``, ``question``, ``answer``, ``metadata``) the scorer is rebuilt as
agentbolt rebuilds it (``reasoning_gym.create_dataset(dataset, **options).score_answer`` on
``{question, answer, metadata}``, 0 when it raises), with the same reasoning-gym version; success
is a score of 1.0. For ``calculator`` (``question``, ``expression``, ``answer``) success is the
right number; that is more lenient than agentbolt's side, whose reward also asks for the exact
tool-call line, then the answer line.

The programs, as DSPy's docs write them, with ``dspy.ChatAdapter`` and the model
``dspy.LM("openai/smollm2", temperature=1.0, cache=False)``: ``dspy.Predict("question ->
answer")`` for a reasoning-gym spec; for ``calculator``, ``dspy.ReAct("question -> answer:
float", tools=[calculator])`` (at most 3 tool steps), the tool evaluating the arithmetic as
agentbolt's calculator does. Where it departs from DSPy's defaults, and why:

- ``max_labeled_demos=0``: labelled demonstrations are gold answers, which agentbolt's optimizer
  never sees; only demonstrations bootstrapped from the model's own successful runs are used.
  The gold answer is kept out of the ``dspy.Example`` (it travels as ``task``, read only by the
  metric), so no demonstration can carry it.
- The ChatAdapter's fallback to the JSONAdapter is off: the fallback asks for
  ``response_format=json_object``, which the embedded engine refuses, so it could only add a
  failing second request to a run. A reply the ChatAdapter cannot parse is an
  ``AdapterParseError``: the run scores 0 and counts as a parse failure.
- The budget. A rollout is one run of the program on one task (one ``Predict`` call, one model
  request; one ``ReAct`` call, one model request per step): bootstrapping runs on training tasks and the candidates' runs on validation tasks
  alike. DSPy's random search evaluates the zero-shot program on validation (``|val|`` runs),
  then per candidate bootstraps over the training tasks until it has its demonstrations (at most
  ``|train|`` runs) and evaluates on validation (``|val|`` runs). Its "labels only" candidate is
  the zero-shot program again when ``max_labeled_demos=0`` and is skipped (``restrict``). So the
  number of bootstrapped candidates is the most the budget covers in the worst case,
  ``(budget - |val|) // (|train| + |val|)``, and the search cannot exceed the budget; the runs
  are counted by a DSPy callback and reported.
- ``--seed`` shuffles the training tasks' order (DSPy's candidate seeds are fixed 0, 1, ...).

Held-out success is measured after the search, outside the budget: the untrained program
(sampled), the optimized one sampled (temperature 1) and greedy (temperature 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import os
import random
import re
import threading
import time
from typing import Any

import dspy
import reasoning_gym
from dspy.teleprompt import BootstrapFewShotWithRandomSearch
from dspy.utils.callback import BaseCallback
from dspy.utils.exceptions import AdapterParseError
from reasoning_gym.factory import DATASETS

NO_LIMIT = 10**9
"""DSPy's ``max_errors``: a parse failure is a failed run, never a reason to stop the search."""


# The scorer: the dataset's own, rebuilt as agentbolt.tasks.reasoning_gym rebuilds it.


def _typed(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` brought to their config defaults' types, as agentbolt's ``configure`` does
    (JSON has no tuples, and reads 1.0 as a float only where written so)."""
    defaults = {f.name: f.default for f in dataclasses.fields(DATASETS[name][1])}
    out = {}
    for key, value in options.items():
        default = defaults.get(key)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        out[key] = value
    return out


@functools.lru_cache(maxsize=32)
def _scorer_of(name: str, options_json: str) -> Any:
    options = _typed(name, json.loads(options_json))
    return reasoning_gym.create_dataset(name, **options).score_answer


def score(data: dict[str, Any], answer: str | None) -> float:
    """The dataset's own score of ``answer`` for the task ``data`` (0 when its scorer raises)."""
    score_answer = _scorer_of(data["dataset"], json.dumps(data["options"], sort_keys=True))
    entry = {"question": data["question"], "answer": data["answer"], "metadata": data["metadata"]}
    try:
        return float(score_answer(answer, entry))
    except Exception:  # a malformed answer some scorers reject by raising
        return 0.0


def right_number(data: dict[str, Any], answer: Any) -> float:
    """The calculator's success: ``answer`` is the task's number."""
    try:
        return float(abs(float(str(answer).strip()) - float(data["answer"])) < 1e-6)
    except (TypeError, ValueError):
        return 0.0


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of whole numbers, + - * / and parentheses."""
    if not re.fullmatch(r"[0-9+\-*/(). ]{1,64}", expression):
        return "error: only numbers and + - * / ( ) are allowed"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - checked to arithmetic above
    except Exception as exc:  # division by zero, a malformed expression
        return f"error: {exc}"


def metric(example: dspy.Example, prediction: dspy.Prediction, trace: Any = None) -> bool:
    if "dataset" not in example.task:  # the calculator task
        return right_number(example.task, prediction.answer) >= 1.0
    return score(example.task, prediction.answer) >= 1.0


def program_for(spec: str) -> dspy.Module:
    """The untrained program for the task ``spec`` names."""
    if spec == "calculator":
        return dspy.ReAct("question -> answer: float", tools=[calculator], max_iters=3)
    return dspy.Predict("question -> answer")


def examples(tasks: list[dict[str, Any]]) -> list[dspy.Example]:
    """The tasks as DSPy examples: the question as input, the task data (gold answer included)
    under ``task``, for the metric only."""
    return [dspy.Example(question=t["question"], task=t).with_inputs("question") for t in tasks]


# Counting: runs, model requests and parse failures, per phase, through DSPy's callbacks.


@dataclasses.dataclass
class Counts:
    runs: int = 0
    """Program runs on a task (``Predict`` calls): rollouts."""
    requests: int = 0
    """Model requests (``dspy.LM`` calls)."""
    parse_failures: int = 0
    """``Predict`` calls whose reply the adapter could not parse (``AdapterParseError``): one
    per failed run of a ``Predict`` program; a ``ReAct`` run may have several."""
    other_errors: int = 0
    """Runs that failed otherwise (a request refused, a timeout)."""


class Counter(BaseCallback):
    """Counts into ``self.phases[self.phase]``; thread-safe (DSPy evaluates in threads). A run is
    a call of a ``unit`` module (the program's top module); parse failures are counted on any
    ``Predict`` inside it."""

    def __init__(self, unit: type = dspy.Predict) -> None:
        self.unit = unit
        self._runs: set[str] = set()
        self.phase = "setup"
        self.phases: dict[str, Counts] = {}
        self._lock = threading.Lock()
        self._predicts: set[str] = set()

    def _counts(self) -> Counts:
        return self.phases.setdefault(self.phase, Counts())

    def on_module_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        with self._lock:
            if isinstance(instance, self.unit):
                self._runs.add(call_id)
                self._counts().runs += 1
            if isinstance(instance, dspy.Predict):
                self._predicts.add(call_id)

    def on_module_end(self, call_id: str, outputs: Any, exception: BaseException | None = None) -> None:
        with self._lock:
            if call_id in self._predicts:
                self._predicts.discard(call_id)
                if isinstance(exception, AdapterParseError):
                    self._counts().parse_failures += 1
            if call_id in self._runs:
                self._runs.discard(call_id)
                if exception is not None and not isinstance(exception, AdapterParseError):
                    self._counts().other_errors += 1

    def on_lm_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        with self._lock:
            self._counts().requests += 1


# The search and the evaluations.


def search_parameters(budget: int, n_train: int, n_val: int) -> tuple[int, set[int]]:
    """``num_candidate_programs`` and the seeds to run (``restrict``) whose worst case fits
    ``budget``: zero-shot on validation, then per bootstrapped candidate every training task
    and validation again. ValueError when not even one bootstrapped candidate fits."""
    candidates = (budget - n_val) // (n_train + n_val)
    if candidates < 1:
        least = 2 * n_val + n_train
        raise ValueError(f"a budget of {budget} rollouts covers no bootstrapped candidate; at least {least}")
    # Seed -3 is zero-shot, -2 "labels only" (zero-shot again without labels), -1 the
    # unshuffled bootstrap, 0.. the shuffled ones.
    return candidates - 1, {-3, *range(-1, candidates - 1)}


def success(program: dspy.Module, tasks: list[dspy.Example], threads: int) -> float:
    evaluate = dspy.Evaluate(
        devset=tasks, metric=metric, num_threads=threads, max_errors=NO_LIMIT, display_progress=False
    )
    results = evaluate(program).results
    return sum(bool(ok) for *_, ok in results) / len(results)


def optimize(
    args: argparse.Namespace, train: list[dspy.Example], val: list[dspy.Example]
) -> tuple[Any, dict]:
    num_candidates, seeds = search_parameters(args.budget, len(train), len(val))
    optimizer = BootstrapFewShotWithRandomSearch(
        metric=metric,
        max_bootstrapped_demos=args.max_demos,
        max_labeled_demos=0,
        max_rounds=1,
        num_candidate_programs=num_candidates,
        num_threads=args.threads,
        max_errors=NO_LIMIT,
    )
    started = time.perf_counter()
    program = optimizer.compile(program_for(args.spec), trainset=train, valset=val, restrict=seeds)
    wall_s = time.perf_counter() - started
    search = {
        "num_candidate_programs": num_candidates,
        "seeds_run": sorted(seeds),
        "max_bootstrapped_demos": args.max_demos,
        "max_labeled_demos": 0,
        "max_rounds": 1,
        "candidate_val_scores": [c["score"] / 100.0 for c in program.candidate_programs],
        "demos_in_best": sum(len(p.demos) for p in program.predictors()),
        "wall_s": round(wall_s, 2),
    }
    return program, search


def run(args: argparse.Namespace) -> dict[str, Any]:
    with open(args.tasks) as f:
        tasks = json.load(f)
    train = examples(tasks["train"])
    random.Random(args.seed).shuffle(train)
    val, heldout = examples(tasks["val"]), examples(tasks["heldout"])
    for data in tasks["train"][:1] if tasks.get("dataset") else []:  # the scorer, before the clock
        score(data, None)

    args.spec = tasks.get("spec")
    counter = Counter(dspy.ReAct if args.spec == "calculator" else dspy.Predict)
    lm = dspy.LM(
        "openai/smollm2",
        api_base=args.base_url,
        api_key="none",
        temperature=1.0,
        max_tokens=args.max_tokens,
        cache=False,
        num_retries=0,  # a retried request would be a hidden second model call
    )
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    dspy.configure(lm=lm, adapter=dspy.ChatAdapter(use_json_adapter_fallback=False), callbacks=[counter])

    counter.phase = "heldout_before"
    before = success(program_for(args.spec), heldout, args.threads)
    counter.phase = "optimization"
    program, search = optimize(args, train, val)
    counter.phase = "heldout_after_sampled"
    after_sampled = success(program, heldout, args.threads)
    counter.phase = "heldout_after_greedy"
    with dspy.context(lm=lm.copy(temperature=0.0)):
        after_greedy = success(program, heldout, args.threads)

    used = counter.phases.get("optimization", Counts())
    return {
        "side": "dspy",
        "dspy_version": importlib.metadata.version("dspy"),
        "reasoning_gym_version": importlib.metadata.version("reasoning-gym"),
        "spec": tasks.get("spec"),
        "seed": args.seed,
        "sizes": {"train": len(train), "val": len(val), "heldout": len(heldout)},
        "budget": args.budget,
        "rollouts": used.runs,
        "within_budget": used.runs <= args.budget,
        "wall_s": search["wall_s"],
        "heldout_before": before,
        "heldout_after_sampled": after_sampled,
        "heldout_after_greedy": after_greedy,
        "search": search,
        "max_tokens": args.max_tokens,
        "counts": {phase: dataclasses.asdict(c) for phase, c in counter.phases.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", required=True, help="the tasks file (see the module docstring)")
    parser.add_argument("--base-url", required=True, help="OpenAI-compatible endpoint serving smollm2")
    parser.add_argument("--budget", type=int, required=True, help="rollouts the search may use")
    parser.add_argument("--seed", type=int, default=0, help="shuffles the training tasks' order")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--max-demos", type=int, default=3, help="max_bootstrapped_demos (agentbolt's max_demos)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="the reply length per run")
    parser.add_argument("--threads", type=int, default=8, help="DSPy's evaluation threads")
    args = parser.parse_args()

    # DSPy fetches LiteLLM's model map from GitHub on first use (5 s timeout); offline, use
    # the copy it ships.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    result = run(args)
    opt = result["counts"].get("optimization", {})
    print(
        f"dspy {result['dspy_version']} {result['spec']} seed={args.seed}: held-out success "
        f"{result['heldout_before']:.3f} before, {result['heldout_after_sampled']:.3f} after sampled, "
        f"{result['heldout_after_greedy']:.3f} greedy; search {result['wall_s']:.1f} s, "
        f"{result['rollouts']}/{args.budget} rollouts, adapter parse failures "
        f"{opt.get('parse_failures', 0)}/{opt.get('runs', 0)} in the search"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
