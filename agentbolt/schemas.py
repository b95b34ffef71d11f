"""The data model: every object that crosses a process boundary is defined here.

Create / Read / Patch models are kept apart (the habit of agent-lightning's schemas module):
what a client may send is stricter (``extra="forbid"``) than what the store returns.
Lifecycles are one ``StrEnum`` per object plus one table of allowed transitions, checked by
:func:`check_transition` — the only place that decides whether a status change is legal.
"""

from __future__ import annotations

import math
import time
import uuid
from enum import StrEnum
from typing import Annotated, Any, Generic, Literal, TypeVar, get_args

import orjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    Tag,
    field_validator,
    model_validator,
)

from agentbolt.errors import InvalidTransition

__all__ = [
    "MAX_EXAMPLE_TURNS",
    "MAX_INT32",
    "AgentEvent",
    "AgentEvents",
    "AgentReward",
    "AgentTypedEvent",
    "AwaitedReward",
    "REWARD_NAME",
    "RewardCreate",
    "RewardScale",
    "RewardScore",
    "RewardSlot",
    "RewardSource",
    "RewardState",
    "WorkerRegister",
    "WorkerRegistration",
    "ErrorBody",
    "ErrorInfo",
    "WaitResult",
    "WaitRequest",
    "EventsQuery",
    "EVENT_CURSOR",
    "FinishRequest",
    "EventsRequest",
    "HeartbeatRequest",
    "DequeueRequest",
    "EnqueueRequest",
    "LLM",
    "Attempt",
    "AttemptFinish",
    "AttemptStatus",
    "Claim",
    "Event",
    "EventCreate",
    "EventSource",
    "ExampleTurn",
    "EventType",
    "Mode",
    "ModelWeights",
    "Page",
    "PromptTemplate",
    "Resource",
    "Resources",
    "ResourcesCreate",
    "Rollout",
    "RolloutCreate",
    "RolloutStatus",
    "SYSTEM_SOURCES",
    "Task",
    "Trajectory",
    "Worker",
    "check_transition",
    "new_id",
    "now",
]


T = TypeVar("T")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def now() -> float:
    return time.time()


def _json_number(value: Any) -> Any:
    if isinstance(value, bool | str | bytes):
        raise ValueError("must be a JSON number")
    return value


NUMBER = BeforeValidator(_json_number)
"""Marks a numeric field of a request model: ``Annotated[int | None, NUMBER]``. Only these
fields pay for the check (a validator on every field cost a Python call per field: a tenth of
the server's time to read a batch of events)."""


class _Strict(BaseModel):
    """What clients send: unknown fields are an error, not silently dropped; a number must be
    a JSON number (pydantic's lax mode would take ``true`` or ``"5"``; ``2.0`` is an integer,
    as JSON Schema says). Every numeric field carries :data:`NUMBER`: a subclass with one that
    does not is refused when it is defined."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        unmarked = [
            name
            for name, field in cls.model_fields.items()
            if _numeric(field.annotation) and NUMBER not in field.metadata
        ]
        if unmarked:
            raise TypeError(f"{cls.__name__}: numeric fields without NUMBER: {', '.join(unmarked)}")


def _numeric(tp: Any) -> bool:
    return tp in (int, float) or any(_numeric(a) for a in get_args(tp))


MAX_INT32 = 2**31 - 1  # resources versions are INTEGER columns


def _check_storable(*values: Any) -> None:
    """Free-form JSON (task data, metadata, event data) must fit the store's JSON encoding,
    which keeps integers to 64 bits: a bigger one is a 422 here, not a 500 at write time."""
    try:
        orjson.dumps(values)
    except TypeError as exc:
        raise ValueError(f"free-form JSON cannot be stored: {exc} (integers must fit in 64 bits)") from None


# ---------------------------------------------------------------------------- lifecycles


class Mode(StrEnum):
    TRAIN = "train"
    VAL = "val"
    TEST = "test"


class RolloutStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in _FINAL_ROLLOUT


class AttemptStatus(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    LEASE_EXPIRED = "lease_expired"
    RELEASED = "released"  # given back by a runner that is stopping; does not use up an attempt
    CANCELLED = "cancelled"  # its rollout was cancelled while it ran


_FINAL_ROLLOUT = {RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED}

VALID_TRANSITIONS: dict[type[StrEnum], dict[StrEnum, set[StrEnum]]] = {
    RolloutStatus: {
        RolloutStatus.QUEUED: {RolloutStatus.RUNNING, RolloutStatus.CANCELLED},
        # running -> queued is a requeue after a lost attempt
        RolloutStatus.RUNNING: {
            RolloutStatus.QUEUED,
            RolloutStatus.SUCCEEDED,
            RolloutStatus.FAILED,
            RolloutStatus.CANCELLED,
        },
        RolloutStatus.SUCCEEDED: set(),
        RolloutStatus.FAILED: set(),
        RolloutStatus.CANCELLED: set(),
    },
    AttemptStatus: {
        AttemptStatus.RUNNING: {
            AttemptStatus.SUCCEEDED,
            AttemptStatus.FAILED,
            AttemptStatus.TIMED_OUT,
            AttemptStatus.LEASE_EXPIRED,
            AttemptStatus.RELEASED,
            AttemptStatus.CANCELLED,
        },
        AttemptStatus.SUCCEEDED: set(),
        AttemptStatus.FAILED: set(),
        AttemptStatus.TIMED_OUT: set(),
        AttemptStatus.LEASE_EXPIRED: set(),
        AttemptStatus.RELEASED: set(),
        AttemptStatus.CANCELLED: set(),
    },
}


def check_transition(kind: str, object_id: str, old: StrEnum, new: StrEnum) -> None:
    """Raise :class:`InvalidTransition` (HTTP 409) unless ``old -> new`` is allowed."""
    allowed = VALID_TRANSITIONS[type(old)][old]
    if new not in allowed:
        raise InvalidTransition(kind, object_id, str(old), str(new))


# ---------------------------------------------------------------------------- tasks and rollouts


class Task(BaseModel):
    """The input an agent works on. ``data`` is free-form JSON (the seed uses ``user_input``)."""

    id: str = Field(default_factory=lambda: new_id("task"))
    data: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, item: Task | dict[str, Any]) -> Task:
        """Accept a Task or a plain dict of task data (``{"id": ...}`` is taken as the id)."""
        if isinstance(item, Task):
            return item
        data = dict(item)
        task_id = data.get("id")
        return cls(id=str(task_id), data=data) if task_id is not None else cls(data=data)


# ---------------------------------------------------------------------------- named rewards
#
# A rollout's own reward (``Rollout.reward``, what the agent returned or emitted) is one reward;
# others come after the run, from an evaluator (a model judge, a scoring function) or from a
# person (a reviewer). Each named reward of a rollout is a *slot* (one per name) holding its
# current score; every score ever given is kept as a revision. A slot the rollout was enqueued
# with (``RolloutCreate.await_rewards``) is *pending* until scored: algorithms never read a
# pending reward as zero.

REWARD_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"
"""A reward's name: letters, digits and ``_ . : -``, 1-64 characters; ``agent`` is reserved for
the rollout's own reward."""


class RewardSource(StrEnum):
    AGENT = "agent"  # the agent's own reward (Rollout.reward); never a slot
    EVALUATOR = "evaluator"  # a model judge or a scoring function, outside the agent
    REVIEWER = "reviewer"  # a person


class RewardState(StrEnum):
    PENDING = "pending"  # awaited, not scored yet
    SCORED = "scored"  # holds a value
    ERROR = "error"  # the evaluator could not score it (malformed answer, timeout, budget): no value


class RewardScale(_Strict):
    """The range a score is given on (a person's 1-5, a judge's 0-1). The value algorithms read
    is the score mapped onto 0-1: ``(score - low) / (high - low)``."""

    low: Annotated[float, NUMBER] = Field(default=0.0, allow_inf_nan=False, ge=-1e9, le=1e9)
    high: Annotated[float, NUMBER] = Field(default=1.0, allow_inf_nan=False, ge=-1e9, le=1e9)
    step: Annotated[float | None, NUMBER] = Field(
        default=None, gt=0, allow_inf_nan=False, description="scores are low + k * step (e.g. 1 for stars)"
    )

    @model_validator(mode="after")
    def _ordered(self) -> RewardScale:
        if not self.high > self.low:
            raise ValueError(f"a scale needs high > low, got low={self.low} high={self.high}")
        return self

    def check(self, score: float) -> None:
        """ValueError naming the range when ``score`` is off the scale."""
        if not (math.isfinite(score) and self.low <= score <= self.high):
            raise ValueError(f"score {score} is outside the scale {self.low:g} to {self.high:g}")
        if self.step is not None:
            k = (score - self.low) / self.step
            if abs(k - round(k)) > 1e-9:
                raise ValueError(
                    f"score {score} is not on the scale's steps ({self.low:g} + k * {self.step:g})"
                )

    def normalise(self, score: float) -> float:
        return (score - self.low) / (self.high - self.low)


class AwaitedReward(_Strict):
    """A named reward a rollout waits for after its run (``RolloutCreate.await_rewards``)."""

    name: str = Field(pattern=REWARD_NAME, json_schema_extra={"not": {"const": "agent"}})
    source: Literal[RewardSource.EVALUATOR, RewardSource.REVIEWER]
    scale: RewardScale = Field(default_factory=RewardScale)

    @field_validator("name")
    @classmethod
    def _not_agent(cls, value: str) -> str:
        if value == "agent":
            raise ValueError("'agent' names the rollout's own reward; choose another name")
        return value


class RewardCreate(_Strict):
    """A score for one named reward of a finished rollout (``POST /api/rollouts/{id}/rewards``).

    ``replaces``: the revision the writer last saw (0 or None: the slot has no score yet). A
    score given meanwhile by someone else makes it a 409, so two people (or a person scoring
    twice at once) never overwrite each other silently; with an ``Idempotency-Key`` a repeated
    request stores nothing new."""

    name: str = Field(pattern=REWARD_NAME)
    score: Annotated[float | None, NUMBER] = Field(
        default=None, allow_inf_nan=False, description="None only with state error"
    )
    state: Literal[RewardState.SCORED, RewardState.ERROR] = RewardState.SCORED
    error: str | None = Field(default=None, max_length=10_000, description="why it could not be scored")
    comment: str | None = Field(default=None, max_length=10_000)
    data: dict[str, Any] = Field(
        default_factory=dict, description="what the score rests on: a judge's reason, its calls, a cut"
    )
    replaces: Annotated[int | None, NUMBER] = Field(default=None, ge=0, le=MAX_INT32)
    scale: RewardScale | None = Field(
        default=None, description="for a slot the rollout did not await (ignored when it did): default 0-1"
    )
    source: Literal[RewardSource.EVALUATOR, RewardSource.REVIEWER] | None = Field(
        default=None, description="admin only; a reviewer or evaluator token decides it"
    )
    author: str | None = Field(
        default=None,
        max_length=200,
        description="who scored (an evaluator's name); a reviewer's is its token's",
    )

    @model_validator(mode="after")
    def _consistent(self) -> RewardCreate:
        if self.name == "agent":
            raise ValueError("'agent' is the rollout's own reward, written by its runner, not here")
        if self.state == RewardState.SCORED and self.score is None:
            raise ValueError("a score is required (state 'scored')")
        if self.state == RewardState.ERROR and (self.score is not None or not self.error):
            raise ValueError("state 'error' takes an error message and no score")
        _check_storable(self.data)
        return self


class RewardScore(BaseModel):
    """One revision of a named reward (the history of a slot is all of them)."""

    id: int
    rollout_id: str
    name: str
    revision: int
    source: RewardSource
    author: str | None = None
    state: RewardState
    score: float | None = None
    value: float | None = Field(default=None, description="the score mapped onto 0-1 by the slot's scale")
    error: str | None = None
    comment: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)
    created_at: float


class RewardSlot(BaseModel):
    """A named reward of a rollout as it stands (``Rollout.rewards[name]``)."""

    name: str
    source: RewardSource
    scale: RewardScale
    state: RewardState
    revision: int = Field(description="0 while pending; each score adds one")
    value: float | None = None
    score: float | None = None
    author: str | None = None
    comment: str | None = None
    error: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)
    updated_at: float


class RolloutCreate(_Strict):
    """One rollout to enqueue. Supplying ``id`` makes the enqueue idempotent."""

    id: str | None = Field(default=None, max_length=200)
    task: Task
    mode: Mode = Mode.TRAIN
    resources_version: Annotated[int | None, NUMBER] = Field(
        default=None, ge=1, le=MAX_INT32, description="None: latest at dequeue time"
    )
    timeout_seconds: Annotated[float | None, NUMBER] = Field(default=None, gt=0, le=7 * 24 * 3600)
    max_attempts: Annotated[int, NUMBER] = Field(default=3, ge=1, le=100)
    group_id: str | None = Field(default=None, max_length=200, description="e.g. a GRPO group")
    metadata: dict[str, Any] = Field(default_factory=dict)
    await_rewards: list[AwaitedReward] = Field(
        default_factory=list,
        max_length=16,
        description="named rewards to come after the run (pending until scored)",
    )

    @field_validator("await_rewards")
    @classmethod
    def _distinct(cls, value: list[AwaitedReward]) -> list[AwaitedReward]:
        names = [r.name for r in value]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be distinct, got {names}")
        return value


class Rollout(BaseModel):
    id: str
    task: Task
    mode: Mode
    status: RolloutStatus
    resources_version: int | None
    timeout_seconds: float | None
    max_attempts: int
    attempts: int = Field(description="attempts started so far (released ones excluded)")
    group_id: str | None = None
    reward: float | None = None
    error: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: float
    updated_at: float
    started_at: float | None = None
    ended_at: float | None = None
    rewards: dict[str, RewardSlot] = Field(
        default_factory=dict, description="named rewards after the run (not the agent's own: that is reward)"
    )

    @property
    def pending_rewards(self) -> list[str]:
        """Names of the awaited rewards not scored yet."""
        return [name for name, slot in self.rewards.items() if slot.state == RewardState.PENDING]


class Attempt(BaseModel):
    id: str
    rollout_id: str
    number: int
    worker_id: str
    status: AttemptStatus
    started_at: float
    heartbeat_at: float
    lease_expires_at: float
    ended_at: float | None = None
    reward: float | None = None
    error: str | None = None


class AttemptFinish(_Strict):
    status: Literal[AttemptStatus.SUCCEEDED, AttemptStatus.FAILED, AttemptStatus.RELEASED]
    reward: Annotated[float | None, NUMBER] = None
    error: str | None = Field(default=None, max_length=100_000)

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("reward must be a finite number")
        return value


class Claim(BaseModel):
    """What a runner gets from a dequeue: the rollout, its new attempt and the resources to use."""

    rollout: Rollout
    attempt: Attempt
    resources: Resources | None
    lease_seconds: float | None = Field(
        default=None, description="the lease the server granted: heartbeat well within it"
    )
    agent_key: str | None = Field(
        default=None, description="this attempt's own credential (None from a server that mints none)"
    )


class Worker(BaseModel):
    id: str
    last_seen: float
    claims: int
    running: int = 0
    revoked_at: float | None = None
    """When an admin revoked this worker (``POST /api/workers/{id}/revoke``); None: it was not."""


# ---------------------------------------------------------------------------- events


class EventType(StrEnum):
    LLM_CALL = "llm_call"
    REWARD = "reward"
    TOOL_CALL = "tool_call"
    MESSAGE = "message"
    EXCEPTION = "exception"
    SPAN = "span"
    STATE = "state"  # the environment's state at a model call: {"key": str, "llm_call_id": int}
    # a reward source the user did not choose (a program's own grade when a scorer decides):
    # {"name": str, "value": float, "reward": float | None, "disputed": bool}; never trained on
    REWARD_CLAIM = "reward_claim"


class EventSource(StrEnum):
    """Who wrote an event. The server sets it from the credential that posted the event (and
    the route: the gateway's recorder writes ``gateway``), never from the request, so an agent
    cannot pass its own records off as the system's: training reads model calls only from
    :data:`SYSTEM_SOURCES`."""

    GATEWAY = "gateway"  # the gateway's recorder: one llm_call per model call
    RUNNER = "runner"  # a runner or worker token: the runner's events, OTLP spans
    AGENT = "agent"  # an attempt's agent key, on its events URL
    SCORER = "scorer"  # reserved: a reward a program computed from the run, not the agent
    EVALUATOR = "evaluator"  # an evaluator token
    REVIEWER = "reviewer"  # a reviewer token
    TRAINER = "trainer"  # reserved: records a trainer adds
    ADMIN = "admin"  # an admin token (tools, tests)


SYSTEM_SOURCES = frozenset({EventSource.GATEWAY, EventSource.RUNNER})
"""The sources whose ``llm_call`` events (token ids, logprobs, prompts, answers) training reads."""


class EventCreate(_Strict):
    """An append-only record. ``sequence`` is per attempt; re-sending one is a no-op.
    Events recorded by the server itself (the gateway, OTLP ingest) carry no sequence."""

    # 2**53 - 1: exact as a JSON number in every client (a double), as a BIGINT in the store
    sequence: Annotated[int | None, NUMBER] = Field(default=None, ge=0, le=2**53 - 1)
    type: str = Field(min_length=1, max_length=100, description="an EventType or a user type")
    timestamp: Annotated[float, NUMBER] = Field(default_factory=now)
    data: dict[str, Any] = Field(default_factory=dict)


class Event(BaseModel):
    id: int
    rollout_id: str
    attempt_id: str
    sequence: int | None
    type: str
    timestamp: float
    data: dict[str, Any]
    source: EventSource | None = Field(
        default=None, description="who wrote it, set by the server; null: stored before sources were kept"
    )


# ---------------------------------------------------------------------------- resources


def _type_required(schema: dict[str, Any]) -> None:
    """``type`` has a default in Python, but the API needs it to tell resources apart."""
    schema["required"] = sorted({*schema.get("required", []), "type"})


class PromptTemplate(BaseModel):
    model_config = ConfigDict(json_schema_extra=_type_required)

    type: Literal["prompt_template"] = "prompt_template"
    template: str
    engine: Literal["f-string", "plain"] = "f-string"

    def format(self, **kwargs: Any) -> str:
        return self.template.format(**kwargs) if self.engine == "f-string" else self.template

    def __str__(self) -> str:
        return self.template


_URL_PATTERN = r"^https?://[\x21-\x7e]+$"
MAX_UPSTREAMS = 64
MAX_EXAMPLE_TURNS = 64


class ExampleTurn(BaseModel):
    """One message of a worked example an ``LLM`` resource carries: a chat message of the
    user, the assistant or a tool (other fields a chat message may have, such as ``tool_calls``
    or ``tool_call_id``, are kept)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class LLM(BaseModel):
    """An OpenAI-compatible endpoint. Inside a rollout ``base_url`` points at the gateway.

    ``upstreams``: more model servers serving the same model beside ``base_url`` (replicas of
    one vLLM deployment): the gateway spreads attempts over all of them, one server per attempt
    (see ``docs/deployment.md``). A claim's LLM names the gateway only, never these."""

    model_config = ConfigDict(json_schema_extra=_type_required)

    type: Literal["llm"] = "llm"
    # an http(s) URL of printable ASCII without spaces (an international host name in its
    # punycode form), and a key an HTTP header can carry: anything else would only fail later,
    # inside the gateway's upstream call. ASCII classes only: the server's pattern engine and a
    # client's (or a fuzzer's) then agree on every character.
    base_url: str = Field(pattern=_URL_PATTERN, max_length=2000)
    model: str
    api_key: str | None = Field(
        default=None, pattern=r"^[\x21-\x7e]*$", description="never stored in events; see the gateway"
    )
    sampling_parameters: dict[str, Any] = Field(default_factory=dict)
    upstreams: list[Annotated[str, Field(pattern=_URL_PATTERN, max_length=2000)]] = Field(
        default_factory=list,
        max_length=MAX_UPSTREAMS,
        description="more servers of the same model beside base_url; the gateway spreads attempts over them",
    )
    examples: list[ExampleTurn] = Field(
        default_factory=list,
        max_length=MAX_EXAMPLE_TURNS,
        description=(
            "worked example turns the gateway puts after the leading system messages of every chat"
            " or Responses call through this resource (see agentbolt.turns); an agent's claim never"
            " carries them"
        ),
    )

    @model_validator(mode="after")
    def _distinct_upstreams(self) -> LLM:
        seen: set[str] = set()
        for url in (self.base_url, *self.upstreams):
            if url.rstrip("/") in seen:
                raise ValueError(f"upstream {url!r} is named twice (base_url and upstreams must all differ)")
            seen.add(url.rstrip("/"))
        return self

    @property
    def servers(self) -> list[str]:
        """Every model server of this resource: ``base_url`` first, then ``upstreams``."""
        return [self.base_url, *self.upstreams]


class ModelWeights(BaseModel):
    model_config = ConfigDict(json_schema_extra=_type_required)

    type: Literal["model_weights"] = "model_weights"
    path: str
    base_model: str | None = None
    format: Literal["lora", "full"] = "lora"
    metadata: dict[str, Any] = Field(default_factory=dict)


Resource = Annotated[PromptTemplate | LLM | ModelWeights, Field(discriminator="type")]


class ResourcesCreate(_Strict):
    resources: dict[str, Resource]
    metadata: dict[str, Any] = Field(default_factory=dict)
    trial: bool = Field(
        default=False,
        strict=True,  # a JSON boolean: lax mode would take 0 or "yes"
        description="a trial (e.g. an APO candidate): never the latest version; only rollouts pinned to it use it",
    )

    @model_validator(mode="after")
    def _storable(self) -> ResourcesCreate:
        _check_storable(self.metadata, [r.model_dump() for r in self.resources.values()])
        return self


class Resources(BaseModel):
    version: int
    resources: dict[str, Resource]
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: float
    trial: bool = Field(default=False, description="a trial version is never the latest")


# ---------------------------------------------------------------------------- results


class Trajectory(BaseModel):
    """What one rollout produced (the seed's shape); ``trace`` holds free-form steps."""

    model_config = ConfigDict(extra="allow")

    task_id: str | None = None
    final_response: Any = None
    total_reward: float | None = None
    trace: list[dict[str, Any]] = Field(default_factory=list)


# ---------------------------------------------------------------------------- request bodies


class EnqueueRequest(_Strict):
    rollouts: list[RolloutCreate] = Field(min_length=1, max_length=10_000)

    @model_validator(mode="after")
    def _storable(self) -> EnqueueRequest:
        _check_storable([(r.task.data, r.task.metadata, r.metadata) for r in self.rollouts])
        return self


class DequeueRequest(_Strict):
    worker_id: str = Field(min_length=1, max_length=200)
    lease_seconds: Annotated[float | None, NUMBER] = Field(default=None, gt=0, le=24 * 3600)
    wait: Annotated[float, NUMBER] = Field(
        default=0.0, ge=0, le=60, description="seconds to long-poll for work"
    )


class HeartbeatRequest(_Strict):
    worker_id: str | None = Field(default=None, max_length=200)
    lease_seconds: Annotated[float | None, NUMBER] = Field(default=None, gt=0, le=24 * 3600)


class EventsRequest(_Strict):
    worker_id: str | None = Field(default=None, max_length=200)
    events: list[EventCreate] = Field(max_length=10_000)

    @model_validator(mode="after")
    def _storable(self) -> EventsRequest:
        _check_storable([e.data for e in self.events])
        return self


class FinishRequest(AttemptFinish):
    worker_id: str | None = Field(default=None, max_length=200)


class WorkerRegister(_Strict):
    name: str | None = Field(
        default=None, min_length=1, max_length=100, description="a hint the issued worker id starts with"
    )


class WorkerRegistration(BaseModel):
    """A new worker identity: the token acts as a runner bound to ``worker_id`` (shown once)."""

    worker_id: str
    worker_token: str
    token_ttl_seconds: float | None = None
    """Seconds the token stays valid after its worker was last seen (a dequeue, a heartbeat);
    None: it never expires. A runner holding an attempt heartbeats within a third of it."""


class AgentTypedEvent(_Strict):
    """An event an agent posts: ``{"type": ..., "data": {...}}`` (type ``state`` has a shape
    of its own, :class:`AgentStateEvent`)."""

    type: str = Field(
        min_length=1,
        max_length=100,
        description="an EventType or a user type (a state declaration is AgentStateEvent)",
        json_schema_extra={"not": {"const": EventType.STATE.value}},
    )
    data: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _storable(self) -> AgentTypedEvent:
        value = self.data.get("value")
        if self.type == EventType.REWARD and isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"a reward must be a finite number, not {value!r}")
        _check_storable(self.data)
        return self

    def to_create(self) -> EventCreate:
        return EventCreate(type=self.type, data=self.data)


class AgentReward(_Strict):
    """The reward shorthand: ``{"reward": x, "name": ..., "call": N}`` is type ``reward``, data
    ``{"value": x, "name": ..., "llm_call_id": N}``; with ``call`` (the id the gateway returned
    for a model call) the reward is that call's, not the rollout's."""

    reward: Annotated[float, NUMBER] = Field(allow_inf_nan=False)
    name: str | None = Field(default=None, max_length=200)
    call: Annotated[int | None, NUMBER] = Field(
        default=None,
        ge=0,
        le=2**53 - 1,
        description="the model call this reward is for: the gateway's call id (X-Agentbolt-Call-Id)",
    )

    def to_create(self) -> EventCreate:
        named = {"name": self.name} if self.name is not None else {}
        called = {"llm_call_id": self.call} if self.call is not None else {}
        return EventCreate(type=EventType.REWARD, data={"value": self.reward, **named, **called})


class StateData(_Strict):
    """The environment's state when the model made a call: ``key`` names it (equal states,
    equal keys), ``llm_call_id`` the call (the gateway's call id)."""

    key: str = Field(min_length=1, max_length=512)
    llm_call_id: Annotated[int, NUMBER] = Field(
        ge=0, le=2**53 - 1, description="the model call: the gateway's call id"
    )


class AgentStateEvent(_Strict):
    """A state declaration: ``{"type": "state", "data": {"key": ..., "llm_call_id": N}}``."""

    type: Literal["state"]
    data: StateData

    def to_create(self) -> EventCreate:
        return EventCreate(type=EventType.STATE, data=self.data.model_dump())


def _event_shape(value: Any) -> str:
    if isinstance(value, dict) and "reward" in value:
        return "reward"
    return "state" if isinstance(value, dict) and value.get("type") == EventType.STATE else "typed"


# the shape is chosen by its keys, so a refusal speaks of that shape alone
AgentEvent = Annotated[
    Annotated[AgentTypedEvent, Tag("typed")]
    | Annotated[AgentReward, Tag("reward")]
    | Annotated[AgentStateEvent, Tag("state")],
    Discriminator(_event_shape),
]


class AgentEvents(RootModel[list[AgentEvent]]):
    """One event, or a JSON list of at most 10,000 (the schema documents the list)."""

    root: list[AgentEvent] = Field(max_length=10_000)

    @model_validator(mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, dict) else value


class WaitRequest(_Strict):
    rollout_ids: list[str] = Field(min_length=1, max_length=10_000)
    timeout: Annotated[float, NUMBER] = Field(default=10.0, ge=0, le=60)


# An events page cursor as the store writes it: "<timestamp>:<event id>".
EVENT_CURSOR = r"^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?:[0-9]{1,18}$"


class EventsQuery(_Strict):
    """The events of many rollouts at once (training and export read whole batches)."""

    rollout_ids: list[str] = Field(min_length=1, max_length=1000)
    type: list[str] | None = Field(default=None, max_length=64)
    limit: Annotated[int, NUMBER] = Field(default=1000, ge=1, le=1000)
    cursor: str | None = Field(default=None, pattern=EVENT_CURSOR)


class WaitResult(BaseModel):
    rollouts: list[Rollout]
    done: bool


class ErrorInfo(BaseModel):
    """``type`` and ``message`` always; OpenAI-style errors (the gateway) add ``param`` and
    ``code``, validation errors add ``details``."""

    model_config = ConfigDict(extra="allow")

    type: str
    message: str


class ErrorBody(BaseModel):
    """Every error the server answers (4xx and 5xx) has this shape."""

    error: ErrorInfo


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = None


Claim.model_rebuild()
