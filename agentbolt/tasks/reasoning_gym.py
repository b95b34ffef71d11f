"""reasoning-gym's datasets as tasks: ``reasoning_gym:<dataset>?<config key>=<value>&...``.

reasoning-gym (PyPI ``reasoning-gym``) generates each dataset's items from a seed and scores an
answer with the dataset's own ``score_answer``; agentbolt uses both as they are, through
``reasoning_gym.create_dataset``. The spec's options are the dataset's config fields
(``spell_backward?max_word_len=4``); ``seed`` and ``size`` are agentbolt's (:mod:`.external`).

- Task data: the dataset's name and the options given, and the item's question, answer and
  metadata, all JSON, so a task travels through the server and the runner rebuilds the dataset
  (and so its scorer) from them.
- The prompt: the system prompt asks for one line ``ANSWER: <answer>``; one worked example, an
  item of the training split drawn from its own seed, shows it (the model answers in sentences
  otherwise, and the scorer then sees none).
- The reward: the text after the reply's first ``ANSWER:``, to the end of its line (None when
  the reply has none), is handed exactly to the dataset's ``score_answer``; its value is the
  rollout's reward. Some datasets give partial credit; success is 1.0. A scorer that raises on
  a malformed answer scores it 0.
- Splits: a hash of the question and answer puts each item in one split (generators repeat
  items), so no held-out item occurs in training, whatever the seeds and the configs.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentbolt.schemas import Task
from agentbolt.tasks.base import Episode, Split, Turn, make_split
from agentbolt.tasks.external import configure, id_prefix

if TYPE_CHECKING:
    from agentbolt.tasks import BuiltinTask

__all__ = ["ReasoningGymEpisode", "extract_answer", "reasoning_gym_task", "score"]

SYSTEM_PROMPT = (
    "You are a careful assistant. Solve the task, then reply with exactly one line "
    "'ANSWER: <answer>' and nothing else."
)
WORKED_SEED = 9_000_001
"""The worked example's seed: its item is drawn from the training split."""
CHUNK = 500
"""Items per generated dataset; the draw moves to a next seed after this many."""
ANSWER = re.compile(r"ANSWER:[ \t]*(.*)")


def extract_answer(reply: str) -> str | None:
    """What follows the first ``ANSWER:`` up to the end of its line, stripped; None without one."""
    match = ANSWER.search(reply)
    return match.group(1).strip() if match else None


def _config_class(name: str) -> type:
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        examples = ", ".join(sorted(DATASETS)[:6])
        raise ValueError(
            f"unknown reasoning-gym dataset {name!r}; {hint}{len(DATASETS)} datasets, e.g. {examples}"
        )
    config: type = DATASETS[name][1]
    return config


def _defaults(name: str) -> dict[str, Any]:
    """The dataset's config fields and their defaults, but ``seed`` and ``size`` (agentbolt's)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(_config_class(name)):
        if f.name in ("seed", "size"):
            continue
        factory: Any = f.default_factory
        if factory is not dataclasses.MISSING:
            out[f.name] = factory()
        else:
            out[f.name] = None if f.default is dataclasses.MISSING else f.default
    return out


def create(name: str, options: dict[str, Any], **draw: Any) -> Any:
    """The dataset ``name`` with ``options`` (checked against its config) and ``draw`` (seed, size)."""
    import reasoning_gym

    config = configure(_defaults(name), options, f"reasoning_gym:{name}")
    try:
        return reasoning_gym.create_dataset(name, **config, **draw)
    except (AssertionError, ValueError, TypeError) as exc:  # the config's validate() asserts
        raise ValueError(f"reasoning_gym:{name}: {exc or type(exc).__name__}") from None


@functools.lru_cache(maxsize=32)
def _scorer_of(name: str, options_json: str) -> Any:
    return create(name, json.loads(options_json)).score_answer


def score(data: dict[str, Any], answer: str | None) -> float:
    """The dataset's own score of ``answer`` for the task ``data`` (0 when its scorer raises)."""
    score_answer = _scorer_of(data["dataset"], json.dumps(data["options"], sort_keys=True))
    entry = {"question": data["question"], "answer": data["answer"], "metadata": data["metadata"]}
    try:
        return float(score_answer(answer, entry))
    except Exception:  # a malformed answer some scorers reject by raising (prime_factorization)
        return 0.0


def _items(name: str, options: dict[str, Any], seed: int) -> Iterator[dict[str, Any]]:
    for chunk in itertools.count():
        dataset = create(name, options, seed=seed * 1_000_003 + chunk, size=CHUNK)
        for index in range(CHUNK):
            yield dataset[index]


def make_tasks(name: str, options: dict[str, Any], n: int, seed: int, split: Split) -> list[Task]:
    """``n`` distinct items of ``split`` (by the hash of question and answer), drawn from ``seed``:
    the same items in every process. Some generators iterate over Python sets (isomorphic_strings
    does), whose order follows the interpreter's string hashing, randomised per process unless
    ``PYTHONHASHSEED`` is fixed; elsewhere the items are drawn in a child interpreter with
    ``PYTHONHASHSEED=0`` (about two seconds), so a resumed run and another process get the same
    tasks for the same seed."""
    if sys.flags.hash_randomization:  # started without PYTHONHASHSEED=0
        return _drawn_elsewhere(name, options, n, seed, split)
    return _draw_here(name, options, n, seed, split)


@functools.lru_cache(maxsize=64)
def _drawn_cached(name: str, options_json: str, n: int, seed: int, split: Split) -> str:
    command = [
        sys.executable,
        "-m",
        "agentbolt.tasks.reasoning_gym",
        name,
        options_json,
        str(n),
        str(seed),
        split,
    ]
    done = subprocess.run(
        command, env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(last.removeprefix("ValueError: "))
    return done.stdout


def _drawn_elsewhere(name: str, options: dict[str, Any], n: int, seed: int, split: Split) -> list[Task]:
    text = _drawn_cached(name, json.dumps(options, sort_keys=True), n, seed, split)
    return [Task.model_validate(item) for item in json.loads(text)]


def _draw_here(name: str, options: dict[str, Any], n: int, seed: int, split: Split) -> list[Task]:
    items = _items(name, options, seed)

    def draw(_rng: Any) -> tuple[str, dict[str, Any]]:
        entry = next(items)
        data = {
            "dataset": name,
            "options": options,
            **{k: entry.get(k) for k in ("question", "answer", "metadata")},
        }
        try:  # what travels through the server is what is scored, here and in the runner
            data = json.loads(json.dumps(data))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"reasoning_gym:{name}: an item is not JSON ({exc})") from None
        return f"{entry['question']}\n{entry['answer']}", data

    return make_split(n, seed, split, draw, id_prefix(f"rg-{name}", options))


@dataclass
class ReasoningGymEpisode(Episode):
    """One question, one reply, scored by the dataset."""

    answer: str | None = None
    reward: float = 0.0

    @property
    def max_turns(self) -> int:
        return 1

    def opening(self) -> str:
        return str(self.data["question"])

    def state(self) -> str:
        return "question " + hashlib.sha256(str(self.data["question"]).encode()).hexdigest()[:16]

    def step(self, reply: str) -> Turn:
        self.replies.append(reply)
        self.answer = extract_answer(reply)
        self.reward = score(self.data, self.answer)
        return Turn(None)

    def outcome(self) -> float:
        return self.reward


def reasoning_gym_task(name: str, options: dict[str, Any], label: str) -> BuiltinTask:
    """The task of dataset ``name`` with config ``options``; ValueError for an unknown dataset or
    option, or a config the dataset refuses."""
    from agentbolt.tasks import BuiltinTask

    [example] = make_tasks(name, options, 1, WORKED_SEED, "train")
    worked = [
        {"role": "user", "content": str(example.data["question"])},
        {"role": "assistant", "content": f"ANSWER: {example.data['answer']}"},
    ]
    return BuiltinTask(
        label,
        f"reasoning-gym's {name}, one answer scored by the dataset's own scorer",
        SYSTEM_PROMPT,
        worked,
        ReasoningGymEpisode,
        functools.partial(make_tasks, name, options),
        max_tokens=48,
    )


if __name__ == "__main__":  # the child of :func:`make_tasks`: the tasks as JSON on stdout
    _name, _options, _n, _seed, _split = sys.argv[1:6]
    _tasks = _draw_here(_name, json.loads(_options), int(_n), int(_seed), _split)  # type: ignore[arg-type]
    sys.stdout.write(json.dumps([t.model_dump(mode="json") for t in _tasks]))
