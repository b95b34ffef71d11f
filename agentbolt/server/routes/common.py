"""What the store's routes share: pre-serialised JSON answers and the cursor pattern.

Hot paths (dequeue, events, finish) return pre-serialised JSON to skip FastAPI's response
re-validation; their ``response_model`` still documents them in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Header
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic_core import to_json

__all__ = ["INT_CURSOR", "IdempotencyKey", "json_response"]

# Cursors as the store writes them (a queue position; "<timestamp>:<event id>" for events):
# anything else is a 422 from validation, not a 400 from the store.
INT_CURSOR = r"^[0-9]{1,18}$"

# The key a client makes for one logical write and sends again with each retry of it: the store
# keeps it on the row the write created and answers a repeat with the first result.
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        pattern=r"^[!-~]{1,200}$",
        description="one key per logical call, sent again by its retries (printable ASCII, at most 200)",
    ),
]


def json_response(model: BaseModel | list[Any] | dict[str, Any] | None, status: int = 200) -> Response:
    """``model`` (or ``null``) serialised once, as the answer."""
    if model is None:
        body = "null"
    elif isinstance(model, BaseModel):
        body = model.model_dump_json()
    else:
        body = to_json(model).decode()
    return Response(content=body, status_code=status, media_type="application/json")
