"""A multi-turn task: find a hidden number from higher/lower hints.

The environment hides a number in a range of 16 to 31 numbers; the model guesses (``GUESS: <number>``) and is
told ``HIGHER`` or ``LOWER`` until it finds it, five guesses at most (enough for a bisection).

Rewards:

- a guess that is consistent with every hint so far (inside the range still open) and new earns
  a step reward of 0.1, recorded on that call;
- the outcome (the rollout's reward) is 1.0 when the number is found with every reply exactly
  one ``GUESS`` line; else 0. Any other reply ends the episode.

The state the model answers from is the range still open (low-high).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from agentbolt.schemas import Task
from agentbolt.tasks.base import Episode, Split, Turn, make_split

__all__ = ["GuessEpisode", "make_tasks"]

GUESSES = 5
STEP_REWARD = 0.1
SYSTEM_PROMPT = (
    "You are playing a guessing game: a whole number in a range is hidden. Reply with exactly one "
    "line 'GUESS: <number>'. You are told HIGHER if the hidden number is higher, LOWER if it is "
    f"lower. Find it in at most {GUESSES} guesses."
)
WORKED_EPISODE = [
    {"role": "user", "content": "Find the hidden number from 1 to 30."},
    {"role": "assistant", "content": "GUESS: 15"},
    {"role": "user", "content": "HIGHER"},
    {"role": "assistant", "content": "GUESS: 23"},
    {"role": "user", "content": "LOWER"},
    {"role": "assistant", "content": "GUESS: 19"},
    {"role": "user", "content": "CORRECT"},
]
GUESS = re.compile(r"GUESS:\s*(\d+)\s*")


def _draw(rng: random.Random) -> tuple[str, dict[str, Any]]:
    low = rng.randint(1, 60)
    high = low + rng.randint(15, 30)  # 16 to 31 numbers: five guesses always suffice
    secret = rng.randint(low, high)
    return f"{low}-{high}:{secret}", {"low": low, "high": high, "secret": secret}


def make_tasks(n: int, seed: int, split: Split = "train") -> list[Task]:
    """``n`` distinct games (range and hidden number) of ``split``; held-out games never occur in
    training."""
    return make_split(n, seed, split, _draw, "guess")


@dataclass
class GuessEpisode(Episode):
    low: int = 0
    high: int = 0
    found: bool = False
    strict: bool = True
    guessed: set[int] = field(default_factory=set)

    @property
    def max_turns(self) -> int:
        return GUESSES

    def __post_init__(self) -> None:
        self.low, self.high = int(self.data["low"]), int(self.data["high"])

    def opening(self) -> str:
        return f"Find the hidden number from {self.data['low']} to {self.data['high']}."

    def state(self) -> str:
        return f"{self.low}-{self.high}"

    def step(self, reply: str) -> Turn:
        self.replies.append(reply)
        match = GUESS.fullmatch(reply.strip())
        if match is None:
            self.strict = False
            return Turn(None)
        guess, secret = int(match.group(1)), int(self.data["secret"])
        reward = STEP_REWARD if self.low <= guess <= self.high and guess not in self.guessed else 0.0
        self.guessed.add(guess)
        if guess == secret:
            self.found = True
            return Turn(None, step_reward=reward)
        if guess < secret:
            self.low = max(self.low, guess + 1)
        else:
            self.high = min(self.high, guess - 1)
        last = len(self.replies) >= GUESSES
        return Turn(None if last else ("HIGHER" if guess < secret else "LOWER"), step_reward=reward)

    def outcome(self) -> float:
        return 1.0 if self.found and self.strict else 0.0
