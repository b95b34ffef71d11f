"""Gymnasium's toy-text environments played as text: ``gymnasium:<env id>?<option>=<value>&...``.

The environment is Gymnasium's own (``gymnasium.make``), stepped through its API: one model turn
per environment step. The model sees the observation drawn as text and replies with one line
``ACTION: <name>``, a legal action's name from the system prompt. The environment's reward
for the step is that turn's step reward; its termination or truncation ends the episode, and so
does ``max_turns`` model turns. A reply that is not exactly one line ``ACTION: <name>`` (any
letter case) naming a legal action ends the episode, outcome 0. The outcome is 1.0 for a
success, the episode terminated with a positive reward, which is

- ``FrozenLake-v1``: reaching the goal G (a random map per task, from ``generate_random_map``;
  options ``map_size`` 4, ``p`` 0.8 (a cell's chance to be frozen), ``is_slippery`` false,
  ``max_turns`` 12);
- ``Taxi-v4``: the passenger dropped off at the destination (``is_rainy``, ``fickle_passenger``
  false, ``max_turns`` 20);
- ``Blackjack-v1``: a won hand (``natural``, ``sab`` false, ``max_turns`` 6).

The state a turn is grouped by is the observation's text: the situation the model answers.
Splits by content: a FrozenLake task is its map (and reset seed when slippery), a Taxi task its
opening state (300 exist, so about 75 held out), a Blackjack task its deal (the reset seed).
One worked episode, played by a planner on a task of the training split, shows the format.
"""

from __future__ import annotations

import difflib
import functools
import random
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentbolt.schemas import Task
from agentbolt.tasks.base import Episode, Split, Turn, make_split
from agentbolt.tasks.external import configure, id_prefix

if TYPE_CHECKING:
    from agentbolt.tasks import BuiltinTask

__all__ = ["ENVS", "GymEpisode", "TextEnv", "gymnasium_task"]

ACTION = re.compile(r"ACTION:\s*([A-Za-z]+)\s*", re.IGNORECASE)
WORKED_SEED = 9_000_001
LETTERS = "RGYB"


@dataclass(frozen=True)
class TextEnv:
    """How one Gymnasium environment is played as text."""

    actions: tuple[str, ...]
    """The actions' names, by action number."""
    rules: str
    defaults: dict[str, Any]
    """Every option and its default: ``max_turns``, the task draw's, and ``gymnasium.make``'s."""
    make_keys: tuple[str, ...]
    """The options that go to ``gymnasium.make``."""
    draw: Callable[[random.Random, dict[str, Any]], tuple[str, dict[str, Any]]]
    """A task's content signature and its ``seed`` (and ``make`` arguments) from a generator."""
    render: Callable[[Any, Any], str]
    """The observation as text, from the unwrapped environment and the observation."""
    expert: Callable[[Any, Any], int]
    """An action for the worked episode."""
    summary: str = ""


def _grid(desc: Any) -> list[list[str]]:
    return [[c.decode() if isinstance(c, bytes) else str(c) for c in row] for row in desc]


def _lake(env: Any, obs: Any) -> str:
    rows = _grid(env.desc)
    row, col = divmod(int(obs), env.ncol)
    rows[row][col] = "P"  # the environment's own ansi drawing marks it with a terminal colour
    return "\n".join(" ".join(r) for r in rows)


def _taxi(env: Any, obs: Any) -> str:
    rows = _grid(env.desc)
    row, col, passenger, destination = env.decode(int(obs))
    rows[1 + row][2 * col + 1] = "T"
    where = "in the taxi" if passenger == 4 else f"waiting at {LETTERS[passenger]}"
    return "\n".join("".join(r) for r in rows) + (
        f"\nThe taxi T is at row {row}, column {col}. Passenger: {where}. Destination: {LETTERS[destination]}."
    )


def _blackjack(env: Any, obs: Any) -> str:
    total, dealer, ace = (int(x) for x in obs)
    shows = "an ace" if dealer == 1 else str(dealer)
    return f"Your cards total {total}{', an ace counted as 11' if ace else ''}. The dealer shows {shows}."


def _planned(env: Any, obs: Any) -> int:
    """The first action of a shortest path to a terminating positive reward over the
    environment's transition table ``P`` (each action's likeliest outcome); 0 when none."""
    start = int(obs)
    first: dict[int, int] = {start: -1}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        for action, outcomes in env.P[state].items():
            _, nxt, reward, done = max(outcomes, key=lambda o: o[0])
            step = action if state == start else first[state]
            if done and reward > 0:
                return int(step)
            if not done and int(nxt) not in first:
                first[int(nxt)] = step
                queue.append(int(nxt))
    return 0


def _draw_lake(rng: random.Random, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    seed = rng.randrange(2**31)
    desc = generate_random_map(size=options["map_size"], p=options["p"], seed=seed)
    signature = "/".join(desc) + (f" {seed}" if options["is_slippery"] else "")
    return signature, {"seed": seed, "make": {"desc": desc}}


def _opening_draw(env_id: str) -> Callable[[random.Random, dict[str, Any]], tuple[str, dict[str, Any]]]:
    """Tasks told apart by the opening state the reset seed gives."""
    envs: dict[str, Any] = {}  # one per setting: making Taxi builds its transition table

    def draw(rng: random.Random, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        seed = rng.randrange(2**31)
        key = repr(sorted(options.items()))
        env = envs.get(key) or envs.setdefault(key, _make(env_id, options, {}))
        obs, _ = env.reset(seed=seed)
        return str(obs), {"seed": seed}

    return draw


def _draw_deal(rng: random.Random, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    seed = rng.randrange(2**31)
    return f"deal {seed}", {"seed": seed}


ENVS: dict[str, TextEnv] = {
    "FrozenLake-v1": TextEnv(
        ("LEFT", "DOWN", "RIGHT", "UP"),
        "You walk on a frozen lake drawn as a grid: P is you, F frozen ice (safe), H a hole (falling "
        "in ends the game), G the goal, S the start. Reach G. Each move goes one cell; a move into "
        "the edge keeps you in place.",
        {"map_size": 4, "p": 0.8, "is_slippery": False, "max_turns": 12},
        ("is_slippery",),
        _draw_lake,
        _lake,
        _planned,
        "reach the goal of a random frozen-lake map",
    ),
    "Taxi-v4": TextEnv(
        ("SOUTH", "NORTH", "EAST", "WEST", "PICKUP", "DROPOFF"),
        "You drive the taxi T on a 5x5 grid drawn as text: '|' is a wall the taxi cannot cross, ':' "
        "is open. Drive to the passenger's letter (R, G, Y or B), PICKUP, drive to the destination "
        "letter and DROPOFF. SOUTH is down, NORTH up, EAST right, WEST left.",
        {"is_rainy": False, "fickle_passenger": False, "max_turns": 20},
        ("is_rainy", "fickle_passenger"),
        _opening_draw("Taxi-v4"),
        _taxi,
        _planned,
        "pick a passenger up and drop them at their destination",
    ),
    "Blackjack-v1": TextEnv(
        ("STICK", "HIT"),
        "You play blackjack against the dealer: end with a total closer to 21 than the dealer's "
        "without going over 21. HIT takes another card; STICK stops, then the dealer plays.",
        {"natural": False, "sab": False, "max_turns": 6},
        ("natural", "sab"),
        _draw_deal,
        _blackjack,
        lambda env, obs: 1 if int(obs[0]) < 17 else 0,
        "win a hand of blackjack",
    ),
}


def _make(env_id: str, options: dict[str, Any], extra: dict[str, Any]) -> Any:
    import gymnasium

    spec = ENVS[env_id]
    return gymnasium.make(env_id, **{k: options[k] for k in spec.make_keys}, **extra)


def _options(env_id: str, given: dict[str, Any]) -> dict[str, Any]:
    if env_id not in ENVS:
        close = difflib.get_close_matches(env_id, ENVS, n=2)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(
            f"gymnasium:{env_id} is not an environment agentbolt plays as text; {hint}"
            f"choose one of: {', '.join(ENVS)}"
        )
    spec = ENVS[env_id]
    options = {**spec.defaults, **configure(spec.defaults, given, f"gymnasium:{env_id}")}
    if options["max_turns"] < 1:
        raise ValueError(f"gymnasium:{env_id}: max_turns must be at least 1")
    return options


@dataclass
class GymEpisode(Episode):
    """One play of the environment; ``data``: ``env``, ``options``, ``seed`` and ``make``."""

    env: Any = None
    obs: Any = None
    won: bool = False

    def __post_init__(self) -> None:
        self.spec = ENVS[self.data["env"]]
        self.options = _options(self.data["env"], self.data["options"])
        self.env = _make(self.data["env"], self.options, self.data.get("make", {}))
        self.obs, _ = self.env.reset(seed=int(self.data["seed"]))

    @property
    def max_turns(self) -> int:
        return int(self.options["max_turns"])

    def opening(self) -> str:
        return self.state()

    def state(self) -> str:
        return self.spec.render(self.env.unwrapped, self.obs)

    def step(self, reply: str) -> Turn:
        self.replies.append(reply)
        match = ACTION.fullmatch(reply.strip())
        name = match.group(1).upper() if match else None
        if name not in self.spec.actions:
            self.env.close()
            return Turn(None)
        self.obs, reward, terminated, truncated, _ = self.env.step(self.spec.actions.index(name))
        self.won = bool(terminated) and float(reward) > 0
        over = terminated or truncated or len(self.replies) >= self.max_turns
        if over:
            self.env.close()
        return Turn(None if over else self.state(), step_reward=float(reward))

    def outcome(self) -> float:
        return 1.0 if self.won else 0.0


def make_tasks(env_id: str, options: dict[str, Any], n: int, seed: int, split: Split) -> list[Task]:
    """``n`` distinct tasks of ``split`` (by content: see the module's doc) drawn from ``seed``."""
    spec, full = ENVS[env_id], _options(env_id, options)

    def draw(rng: random.Random) -> tuple[str, dict[str, Any]]:
        signature, data = spec.draw(rng, full)
        return f"{env_id} {signature}", {"env": env_id, "options": options, **data}

    return make_split(n, seed, split, draw, id_prefix(f"gym-{env_id}", options))


def _worked(env_id: str, options: dict[str, Any]) -> list[dict[str, str]]:
    """The shortest win of the planner over 20 training tasks drawn from their own seed, as chat
    turns; the environment's own settings and ``max_turns`` at their defaults (no slippery ice)."""
    spec, wins = ENVS[env_id], []
    drawn = {k: v for k, v in options.items() if k not in (*spec.make_keys, "max_turns")}
    for task in make_tasks(env_id, drawn, 20, WORKED_SEED, "train"):
        episode = GymEpisode(task.data)
        messages = [{"role": "user", "content": episode.opening()}]
        for _ in range(episode.max_turns):
            reply = f"ACTION: {spec.actions[spec.expert(episode.env.unwrapped, episode.obs)]}"
            turn = episode.step(reply)
            messages.append({"role": "assistant", "content": reply})
            if turn.observation is None:
                break
            messages.append({"role": "user", "content": turn.observation})
        if episode.won:
            wins.append([*messages, {"role": "user", "content": "You succeeded. A new game:"}])
    if not wins:
        raise ValueError(f"gymnasium:{env_id}: no worked example found with these options")
    return min(wins, key=len)


def gymnasium_task(env_id: str, options: dict[str, Any], label: str) -> BuiltinTask:
    """The task of environment ``env_id`` with ``options``; ValueError for an environment
    agentbolt does not play or an unknown option."""
    from agentbolt.tasks import BuiltinTask

    full = _options(env_id, options)
    spec = ENVS[env_id]
    slippery = " The ice is slippery: a move may go sideways." if full.get("is_slippery") else ""
    prompt = (
        f"{spec.rules}{slippery} Each turn, reply with exactly one line 'ACTION: <name>' where <name> "
        f"is one of: {', '.join(spec.actions)}. Any other reply ends the game."
    )
    return BuiltinTask(
        label,
        f"Gymnasium's {env_id}: {spec.summary}, one action per turn, up to {full['max_turns']} turns",
        prompt,
        _worked(env_id, options),
        GymEpisode,
        functools.partial(make_tasks, env_id, options),
        max_tokens=16,
    )
