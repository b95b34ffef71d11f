"""Writes ``vllm_0_34_0.json``: the parts of vLLM's HTTP API this project relies on, read from
vLLM's own source (its pydantic request/response models), never from vLLM at run time.

Run once per vLLM version, by hand (vLLM is not installed here: it needs torch with CUDA)::

    pip download vllm==0.34.0 --no-deps -d /tmp/vllm-wheel
    unzip -q /tmp/vllm-wheel/vllm-0.34.0-*.whl 'vllm/*.py' 'vllm/entrypoints/*' -d /tmp/vllm-src
    python tests/contracts/extract_vllm_shapes.py /tmp/vllm-src > tests/contracts/vllm_0_34_0.json

``SPEC`` below is what this project sends and reads (``test_vllm_contract.py`` checks it against
the project's code); the script looks every model and field up in vLLM's source with :mod:`ast`
and writes its type as vLLM writes it, or ``null`` where vLLM has no such field.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

CHAT = "vllm/entrypoints/openai/chat_completion/protocol.py"
COMPLETION = "vllm/entrypoints/openai/completion/protocol.py"
RESPONSES = "vllm/entrypoints/openai/responses/protocol.py"
ENGINE = "vllm/entrypoints/serve/engine/protocol.py"
BASE = "vllm/entrypoints/generate/base/protocol.py"
LORA = "vllm/entrypoints/serve/lora/protocol.py"
ROUTES = {
    "POST /v1/chat/completions": "vllm/entrypoints/openai/chat_completion/api_router.py",
    "POST /v1/completions": "vllm/entrypoints/openai/completion/api_router.py",
    "POST /v1/responses": "vllm/entrypoints/openai/responses/api_router.py",
    "GET /v1/models": "vllm/entrypoints/openai/models/api_router.py",
    "POST /v1/load_lora_adapter": "vllm/entrypoints/serve/lora/api_router.py",
    "POST /v1/unload_lora_adapter": "vllm/entrypoints/serve/lora/api_router.py",
}
# Read for behaviour, not fields: what a LoRA load answers and refuses, /v1/models' cards, what
# fills a Response's input/output messages, and the weight-update routes (which the project does
# not call: the weight sync loads LoRA adapters).
ALSO_READ = [
    "vllm/entrypoints/openai/models/serving.py",
    "vllm/entrypoints/openai/responses/context.py",
    "vllm/entrypoints/openai/responses/serving.py",
    "vllm/entrypoints/rl/online/api_router.py",
    "vllm/entrypoints/launchers/api_server/routers.py",
    "vllm/exceptions.py",
    "vllm/_version.py",
]

_CHAT_LOGPROBS = {"": "ChatCompletionLogProbs", "content[]": "ChatCompletionLogProbsContent"}
_COMPLETION_LOGPROBS = {"": "CompletionLogProbs"}


def _nest(prefix: str, models: dict[str, str]) -> dict[str, str]:
    return {(f"{prefix}.{k}" if k else prefix): v for k, v in models.items()}


# Per endpoint: the vLLM model at each place of the body (``""``: the body itself), what the
# project sends (request fields) and the paths it reads. A path's last part is a field of the
# model at the place before it.
SPEC: dict[str, dict[str, Any]] = {
    "POST /v1/chat/completions": {
        "request": {"": "ChatCompletionRequest", "stream_options": "StreamOptions"},
        "sends": ["return_token_ids", "logprobs", "stream", "stream_options.include_usage"],
        "response": {
            "": "ChatCompletionResponse",
            "choices[]": "ChatCompletionResponseChoice",
            "choices[].message": "ChatMessage",
            **_nest("choices[].logprobs", _CHAT_LOGPROBS),
            "usage": "UsageInfo",
        },
        "reads": [
            "prompt_token_ids",
            "prompt_text",
            "usage",
            "model",
            "choices[].index",
            "choices[].message",
            "choices[].finish_reason",
            "choices[].token_ids",
            "choices[].logprobs.content[].logprob",
        ],
        "stream": {
            "": "ChatCompletionStreamResponse",
            "choices[]": "ChatCompletionResponseStreamChoice",
            "choices[].delta": "DeltaMessage",
            "choices[].delta.tool_calls[]": "DeltaToolCall",
            "choices[].delta.tool_calls[].function": "DeltaFunctionCall",
            **_nest("choices[].logprobs", _CHAT_LOGPROBS),
            "usage": "UsageInfo",
        },
        "stream_reads": [
            "id",
            "created",
            "model",
            "system_fingerprint",
            "prompt_token_ids",
            "usage",
            "choices[].index",
            "choices[].delta.role",
            "choices[].delta.content",
            "choices[].delta.tool_calls",
            "choices[].delta.tool_calls[].index",
            "choices[].delta.tool_calls[].id",
            "choices[].delta.tool_calls[].type",
            "choices[].delta.tool_calls[].function.name",
            "choices[].delta.tool_calls[].function.arguments",
            "choices[].finish_reason",
            "choices[].token_ids",
            "choices[].logprobs.content[].logprob",
        ],
    },
    "POST /v1/completions": {
        "request": {"": "CompletionRequest", "stream_options": "StreamOptions"},
        "sends": ["return_token_ids", "logprobs", "stream", "stream_options.include_usage"],
        "response": {
            "": "CompletionResponse",
            "choices[]": "CompletionResponseChoice",
            **_nest("choices[].logprobs", _COMPLETION_LOGPROBS),
            "usage": "UsageInfo",
        },
        "reads": [
            "usage",
            "model",
            "choices[].index",
            "choices[].text",
            "choices[].finish_reason",
            "choices[].token_ids",
            "choices[].prompt_token_ids",
            "choices[].prompt_text",
            "choices[].logprobs.token_logprobs",
        ],
        "stream": {
            "": "CompletionStreamResponse",
            "choices[]": "CompletionResponseStreamChoice",
            **_nest("choices[].logprobs", _COMPLETION_LOGPROBS),
            "usage": "UsageInfo",
        },
        "stream_reads": [
            "id",
            "created",
            "model",
            "system_fingerprint",
            "usage",
            "choices[].index",
            "choices[].text",
            "choices[].finish_reason",
            "choices[].token_ids",
            "choices[].prompt_token_ids",
            "choices[].logprobs.tokens",
            "choices[].logprobs.token_logprobs",
            "choices[].logprobs.top_logprobs",
            "choices[].logprobs.text_offset",
        ],
    },
    "POST /v1/responses": {
        "request": {"": "ResponsesRequest"},
        # passed through as the agent wrote it, plus the asks for token ids and logprobs
        # (``include: ["message.output_text.logprobs"]``)
        "sends": ["enable_response_messages", "include"],
        "response": {
            "": "ResponsesResponse",
            "usage": "ResponseUsage",
            "input_messages[]": "ResponseRawMessageAndToken",
            "output_messages[]": "ResponseRawMessageAndToken",
        },
        "reads": [
            "id",
            "model",
            "status",
            "output",
            "usage.input_tokens",
            "usage.output_tokens",
            "top_logprobs",
            "input_messages",
            "input_messages[].type",
            "input_messages[].tokens",
            "output_messages",
            "output_messages[].type",
            "output_messages[].tokens",
        ],
        # the stream's final event (response.completed / response.incomplete) carries the body
        "stream": {
            "": "ResponseCompletedEvent",
            "response": "ResponsesResponse",
            "response.input_messages[]": "ResponseRawMessageAndToken",
            "response.output_messages[]": "ResponseRawMessageAndToken",
        },
        "stream_reads": ["response", "response.input_messages[].tokens", "response.output_messages[].tokens"],
    },
    "GET /v1/models": {
        "response": {"": "ModelList", "data[]": "ModelCard"},
        "reads": ["object", "data[].id"],  # the gateway passes the list on; probes read the status
    },
    "POST /v1/load_lora_adapter": {
        "request": {"": "LoadLoRAAdapterRequest"},
        "sends": ["lora_name", "lora_path"],
    },
    "POST /v1/unload_lora_adapter": {"request": {"": "UnloadLoRAAdapterRequest"}, "sends": []},
}
ERROR = {"": "ErrorResponse", "error": "ErrorInfo"}


def _classes(root: Path) -> dict[str, tuple[str, ast.ClassDef]]:
    found: dict[str, tuple[str, ast.ClassDef]] = {}
    for rel in (CHAT, COMPLETION, RESPONSES, ENGINE, BASE, LORA):
        for node in ast.parse((root / rel).read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, (rel, node))
    return found


def _fields(classes: dict[str, tuple[str, ast.ClassDef]], name: str) -> dict[str, str]:
    """Field name -> annotation as written, bases first (those found in the files read)."""
    _, node = classes[name]
    out: dict[str, str] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out |= _fields(classes, base.id)
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            field, annotation = stmt.target.id, ast.unparse(stmt.annotation)
            if not field.startswith("_") and not annotation.startswith("ClassVar"):
                out[field] = annotation
    return out


def _extra(classes: dict[str, tuple[str, ast.ClassDef]], name: str) -> str:
    """The model's ``extra`` setting: its own ``model_config``, a base's, or pydantic's default."""
    _, node = classes[name]
    for stmt in node.body:
        if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "model_config":
            match = re.search(r"extra=['\"](\w+)['\"]", ast.unparse(stmt.value))
            if match:
                return match.group(1)
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            return _extra(classes, base.id)
    return "ignore"  # pydantic's default: unknown fields dropped, no error


def _model(classes: dict[str, tuple[str, ast.ClassDef]], name: str) -> dict[str, Any]:
    return {"file": classes[name][0], "extra": _extra(classes, name), "fields": _fields(classes, name)}


def _request_model(classes: dict[str, tuple[str, ast.ClassDef]], name: str) -> dict[str, Any]:
    """Where it is and its ``extra``; its fields too when it is small (the chat, completions and
    Responses requests have dozens, of which ``sends`` names the ones used)."""
    model = _model(classes, name)
    return model if len(model["fields"]) <= 8 else {k: model[k] for k in ("file", "extra")}


def _paths(classes: dict[str, Any], models: dict[str, str], reads: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for path in reads:
        place, _, field = path.rpartition(".")
        model = models[place]
        annotation = _fields(classes, model).get(field)
        out[path] = None if annotation is None else f"{model}.{field}: {annotation}"
    return out


def _route_declared(root: Path, route: str) -> bool:
    method, path = route.split()
    source = (root / ROUTES[route]).read_text(encoding="utf-8")
    return f'"{path}"' in source and f"router.{method.lower()}" in source


def extract(root: Path) -> dict[str, Any]:
    classes = _classes(root)
    version = re.search(r"__version__ = version = '([^']+)'", (root / "vllm/_version.py").read_text())
    assert version, "no version in vllm/_version.py"
    weights = (root / "vllm/entrypoints/rl/online/api_router.py").read_text(encoding="utf-8")
    assert '@router.post("/update_weights")' in weights and "/v1/update_weights" not in weights
    used: set[str] = set(ERROR.values())  # response models: every field recorded
    requests: set[str] = set()  # request models: only where they are and their ``extra``
    endpoints: dict[str, Any] = {}
    for route, spec in SPEC.items():
        assert _route_declared(root, route), f"{route} not declared in {ROUTES[route]}"
        entry: dict[str, Any] = {"route_file": ROUTES[route]}
        if "request" in spec:
            requests.update(spec["request"].values())
            entry["request"] = {
                "models": spec["request"],
                "extra": _extra(classes, spec["request"][""]),
                "sends": _paths(classes, spec["request"], spec["sends"]),
            }
        for kind, reads in (("response", "reads"), ("stream", "stream_reads")):
            if kind in spec:
                entry[kind] = {"models": spec[kind], "reads": _paths(classes, spec[kind], spec[reads])}
                used.update(spec[kind].values())
        endpoints[route] = entry
    return {
        "vllm": version.group(1),
        "source": f"vllm-{version.group(1)} wheel from PyPI (its Python source, read with ast)",
        "files": sorted(
            {c[0] for n, c in classes.items() if n in used | requests} | set(ROUTES.values()) | set(ALSO_READ)
        ),
        "endpoints": endpoints,
        "error": ERROR,
        "request_models": {name: _request_model(classes, name) for name in sorted(requests)},
        "response_models": {name: _model(classes, name) for name in sorted(used)},
        "behaviour": {
            "unknown_request_fields": "OpenAIBaseModel: extra='allow' (kept, logged at debug, not "
            "an error); LoadLoRAAdapterRequest/UnloadLoRAAdapterRequest: plain BaseModel, "
            "pydantic's default extra='ignore' (dropped, not an error)",
            "load_lora_adapter_ok": '200 with a plain text body (not JSON): "Success: LoRA adapter '
            "'{lora_name}' added successfully.\"",
            "load_lora_adapter_refuses": [
                "400 when lora_name or lora_path is empty",
                "400 when lora_name is a served base model's name",
                "400 when lora_name is already loaded and load_inplace is false",
                "404 when the adapter is not found at lora_path",
            ],
            "load_lora_adapter_routes": "only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
            "models_lists_adapters": "a loaded adapter is a ModelCard: id=lora_name, root=lora_path, "
            "parent=the base model",
            "responses_token_ids": "with enable_response_messages, a model without the Harmony "
            "format (SimpleContext) answers input_messages=[prompt] and output_messages=[completion], "
            "each a ResponseRawMessageAndToken (raw_message_tokens: message, tokens); Harmony models "
            "(gpt-oss) answer Harmony messages without tokens, and refuse (400, param logprobs) "
            "include=['message.output_text.logprobs']; built-in tools that run several model "
            "turns give one output message per turn and prompt",
            "responses_logprobs": "with include=['message.output_text.logprobs'], one logprob per "
            "generated token on the output_text part (top_logprobs: the request's, default 0)",
            "update_weights": "POST /update_weights (no /v1 prefix), only with VLLM_SERVER_DEV_MODE=1 "
            "(vllm/entrypoints/rl/online/api_router.py); its body is {update_info: ...} for the "
            "weight-transfer engine that /init_weight_transfer_engine set up (NCCL or IPC), between "
            "/start_weight_update and /finish_weight_update: no checkpoint path",
        },
    }


if __name__ == "__main__":
    json.dump(extract(Path(sys.argv[1])), sys.stdout, indent=1)
    sys.stdout.write("\n")
