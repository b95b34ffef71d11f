"""Every number a client sends must be a JSON number: ``true`` and ``"5"`` are refused in every
numeric field of every request model (pydantic's lax mode would take them), ``2.0`` is an
integer (as JSON Schema says), and a fraction is not."""

from __future__ import annotations

import inspect
import json
from typing import Annotated, Any, get_args

import pytest
from pydantic import BaseModel, ValidationError

from agentbolt import schemas


def _numeric(tp: Any) -> bool:
    return tp in (int, float) or any(_numeric(a) for a in get_args(tp))


def _integer(tp: Any) -> bool:
    return tp is int or any(_integer(a) for a in get_args(tp))


REQUESTS = [
    cls
    for cls in vars(schemas).values()
    if inspect.isclass(cls) and issubclass(cls, schemas._Strict) and cls is not schemas._Strict
]
FIELDS = [
    (cls, name, _integer(field.annotation))
    for cls in REQUESTS
    for name, field in cls.model_fields.items()
    if _numeric(field.annotation)
]


def _valid(cls: type[BaseModel]) -> dict[str, Any]:
    """A valid payload for ``cls``, from the examples its tests already rely on."""
    examples: dict[str, dict[str, Any]] = {
        "RewardCreate": {"name": "r", "score": 1.0},
        "RolloutCreate": {"task": {"data": {}}},
        "EventCreate": {"type": "x", "data": {}},
        "DequeueRequest": {"worker_id": "w"},
        "HeartbeatRequest": {},
        "AttemptFinish": {"status": "succeeded"},
        "FinishRequest": {"status": "succeeded"},
        "AgentReward": {"reward": 1.0},
        "StateData": {"key": "k", "llm_call_id": 1},
        "WaitRequest": {"rollout_ids": ["ro-1"]},
        "EventsQuery": {"rollout_ids": ["ro-1"]},
        "RewardScale": {"low": 0, "high": 10},
    }
    return dict(examples[cls.__name__])


def test_the_scan_found_the_numeric_fields():
    names = {(cls.__name__, name) for cls, name, _ in FIELDS}
    assert {("EventCreate", "sequence"), ("EventCreate", "timestamp"), ("DequeueRequest", "wait")} <= names
    assert len(FIELDS) >= 15


@pytest.mark.parametrize(("cls", "name", "integer"), FIELDS, ids=[f"{c.__name__}.{n}" for c, n, _ in FIELDS])
def test_a_numeric_field_takes_json_numbers_only(cls, name, integer):
    base = _valid(cls)
    cls.model_validate({**base, name: 2})  # an integer is a number in every numeric field
    cls.model_validate_json(json.dumps({**base, name: 2.0}))  # 2.0 is an integer too (JSON Schema)
    for bad in (True, "2", b"2"):
        with pytest.raises(ValidationError) as caught:
            cls.model_validate({**base, name: bad})
        assert caught.value.errors()[0]["loc"][0] == name
    with pytest.raises(ValidationError):
        cls.model_validate_json(json.dumps({**base, name: True}))
    if integer:
        with pytest.raises(ValidationError):
            cls.model_validate({**base, name: 2.5})


def test_a_request_model_with_an_unmarked_numeric_field_is_refused_when_defined():
    with pytest.raises(TypeError, match="numeric fields without NUMBER: count"):

        class _Unmarked(schemas._Strict):
            name: str
            count: int | None = None

    class _Marked(schemas._Strict):
        count: Annotated[int | None, schemas.NUMBER] = None

    assert _Marked.model_validate({"count": 2}).count == 2
