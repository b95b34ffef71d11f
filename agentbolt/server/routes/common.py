"""What the store's routes share: pre-serialised JSON answers and the cursor pattern.

Hot paths (dequeue, events, finish) return pre-serialised JSON to skip FastAPI's response
re-validation; their ``response_model`` still documents them in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel
from pydantic_core import to_json

__all__ = ["INT_CURSOR", "json_response"]

# Cursors as the store writes them (a queue position; "<timestamp>:<event id>" for events):
# anything else is a 422 from validation, not a 400 from the store.
INT_CURSOR = r"^[0-9]{1,18}$"


def json_response(model: BaseModel | list[Any] | dict[str, Any] | None, status: int = 200) -> Response:
    """``model`` (or ``null``) serialised once, as the answer."""
    if model is None:
        body = "null"
    elif isinstance(model, BaseModel):
        body = model.model_dump_json()
    else:
        body = to_json(model).decode()
    return Response(content=body, status_code=status, media_type="application/json")
