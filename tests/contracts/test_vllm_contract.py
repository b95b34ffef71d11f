"""The vLLM contract: what the gateway and the weight sync send to and read from vLLM, against
vLLM's own request/response models (``vllm_0_34_0.json``, extracted from vLLM 0.34.0's source by
``extract_vllm_shapes.py``), and the upstream test double against the same shapes.

No vLLM runs here: the double stands in, so these tests are what keeps it honest. They fail when
the project starts sending or reading a field the shapes do not record, when the shapes say a
field the project relies on is absent from vLLM (the known gaps are listed in ``NOT_IN_VLLM``),
or when the double's answers and the shapes drift apart.
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbolt.algorithms.policy import RemotePolicy
from agentbolt.server import openai_format, responses_ids
from agentbolt.server.gateway_send import EXTRAS, asked_in
from agentbolt.server.openai_format import CHAT, COMPLETIONS, RESPONSES, StreamAssembler, extract, prepare

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))
from upstream_double import BASE_MODEL, UpstreamDouble  # noqa: E402

SHAPES = json.loads((Path(__file__).parent / "vllm_0_34_0.json").read_text(encoding="utf-8"))
ENDPOINTS: dict[str, Any] = SHAPES["endpoints"]
ROUTE = {
    CHAT: "POST /v1/chat/completions",
    COMPLETIONS: "POST /v1/completions",
    RESPONSES: "POST /v1/responses",
}
LORA = "POST /v1/load_lora_adapter"

# What the project reads that vLLM 0.34.0 does not send, and why that is harmless (or not).
NOT_IN_VLLM = {
    # stripped from the agent's answer when it did not ask for ids; vLLM only has it on chat
    ("POST /v1/completions", "response", "choices[].prompt_text"),
}
# Keys the gateway reads that are not vLLM's: the embedded engine's weight-version reports, and
# the items of a Responses ``output`` (the ``openai`` package's types, which vLLM imports).
NOT_FROM_VLLM = {"model_version", "model_version_mixed", "model_versions"}
OPENAI_OUTPUT_ITEMS = {"type", "content", "text", "name", "arguments", "call_id"}
# Where the gateway reads upstream answers: (file, function or Class.method).
READERS = [
    ("agentbolt/server/openai_format.py", "extract"),
    ("agentbolt/server/openai_format.py", "_logprob_values"),
    ("agentbolt/server/openai_format.py", "StreamAssembler.add"),
    ("agentbolt/server/openai_format.py", "StreamAssembler._add_choice"),
    ("agentbolt/server/openai_format.py", "StreamAssembler._add_tool_call"),
    ("agentbolt/server/gateway_record.py", "CallRecorder.success"),
    ("agentbolt/server/gateway_responses.py", "ResponsesUpstream._relay"),
    ("agentbolt/server/gateway_responses.py", "ResponsesUpstream._data"),
    ("agentbolt/server/responses.py", "chat_choice"),
    ("agentbolt/server/responses.py", "chat_usage"),
    ("agentbolt/server/responses_ids.py", "recorded_ids"),
    ("agentbolt/server/responses_ids.py", "_tokens"),
    ("agentbolt/server/responses_ids.py", "_logprobs"),
]
# The project's own dicts inside those functions (not the upstream's answer).
OWN = {"state", "record", "out", "data", "slot", "merged", "headers", "self"}


def _fields(model: str) -> dict[str, str]:
    return SHAPES["response_models"][model]["fields"]


def _recorded(route: str, kind: str) -> dict[str, str | None]:
    return ENDPOINTS[route][kind]["reads"]


def _at(body: Any, path: str) -> list[Any]:
    """The values at ``path`` (``a.b[].c``); a missing key or a None on the way gives none."""
    values = [body]
    for part in path.split("."):
        key, many = part.removesuffix("[]"), part.endswith("[]")
        values = [v[key] for v in values if isinstance(v, dict) and v.get(key) is not None]
        if many:
            values = [item for v in values for item in v]
    return values


def _places(body: Any, models: dict[str, str]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(place, vLLM model, the dict there) for every place of ``models`` found in ``body``."""
    for place, model in models.items():
        for value in _at(body, place) if place else [body]:
            if isinstance(value, dict):
                yield place, model, value


def _check_answer(bodies: list[dict[str, Any]], route: str, kind: str, absent_ok: set[str]) -> None:
    """Every key the double sent is a field of vLLM's model at that place; every recorded path
    vLLM has is there (somewhere in ``bodies``: a stream's chunks) unless ``absent_ok`` names it;
    every path vLLM lacks is not."""
    shape = ENDPOINTS[route][kind]
    for body in bodies:
        for place, model, value in _places(body, shape["models"]):
            extra = set(value) - set(_fields(model))
            assert not extra, (
                f"{route} {kind}: the double sends {sorted(extra)} at {place!r}; {model} has none"
            )
    for path, field in shape["reads"].items():
        found = any(_at(body, path) for body in bodies)
        if field is None:
            assert not found, f"{route} {kind}: the double sends {path}, which vLLM does not"
        elif path not in absent_ok:
            assert found, f"{route} {kind}: {path} ({field}) missing from the double's answer"


@pytest.fixture(scope="module")
def double() -> Iterator[UpstreamDouble]:
    with UpstreamDouble() as upstream:
        yield upstream


def _sse(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def _ask(double: UpstreamDouble, endpoint: str, body: dict[str, Any]) -> httpx.Response:
    """``body`` as the gateway sends it: token ids, logprobs and stream usage asked for."""
    upstream, _ = prepare(endpoint, body, ask_token_ids=True)
    path = "chat/completions" if endpoint == CHAT else "completions"
    response = httpx.post(f"{double.base_url}/{path}", json=upstream, timeout=10)
    assert response.status_code == 200, response.text
    return response


CHAT_TOOL = {
    "model": BASE_MODEL,
    "messages": [{"role": "user", "content": "weather?"}],
    "tools": [
        {
            "type": "function",
            "function": {"name": "weather", "parameters": {"properties": {"city": {"type": "string"}}}},
        }
    ],
}
CHAT_TEXT = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": BASE_MODEL, "prompt": "Once"}


# ---------------------------------------------------------------- the shapes file itself


def test_the_shapes_name_vllm_034_and_the_files_read():
    assert SHAPES["vllm"] == "0.34.0"
    assert "vllm/entrypoints/openai/chat_completion/protocol.py" in SHAPES["files"]
    assert "vllm/entrypoints/serve/lora/protocol.py" in SHAPES["files"]
    for route, entry in ENDPOINTS.items():
        assert entry["route_file"] in SHAPES["files"], route


def test_every_gap_between_the_project_and_vllm_is_a_known_one():
    """A path the project reads (or a field it sends) that vLLM lacks is listed, with why."""
    gaps = {
        (route, kind, path)
        for route, entry in ENDPOINTS.items()
        for kind in ("response", "stream")
        if kind in entry
        for path, field in entry[kind]["reads"].items()
        if field is None
    }
    assert gaps == NOT_IN_VLLM
    unsent = [
        (r, p)
        for r, e in ENDPOINTS.items()
        for p, f in e.get("request", {"sends": {}})["sends"].items()
        if f is None
    ]
    assert not unsent, f"the project sends fields vLLM's request models do not have: {unsent}"


# ---------------------------------------------------------------- (a) the project against the shapes


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stream", [False, True])
def test_what_the_gateway_adds_to_a_request_is_recorded_with_vllms_type(endpoint, stream):
    body = {**(CHAT_TEXT if endpoint == CHAT else COMPLETION), "stream": stream}
    upstream, _ = prepare(endpoint, body, ask_token_ids=True)
    added = {k for k in upstream if upstream[k] != body.get(k) and k != "stream_options"}
    added |= {f"stream_options.{k}" for k in upstream.get("stream_options") or {}}  # each key of it
    sends = ENDPOINTS[ROUTE[endpoint]]["request"]["sends"]
    assert added, "prepare added nothing: the check below would be empty"
    for name in added:
        assert name in sends, f"the gateway sends {name} to {ROUTE[endpoint]}; not in the shapes"
        (value,) = _at(upstream, name)
        vllm_type = sends[name].split(": ", 1)[1].split(" | ")[0]
        assert type(value).__name__ == vllm_type, f"{name}={value!r}; vLLM's field is {sends[name]}"


def test_the_extras_the_gateway_may_drop_are_vllm_request_fields():
    for endpoint, route in ROUTE.items():
        fields = {asked_in(endpoint, name) for name in EXTRAS[endpoint]}
        assert fields <= set(ENDPOINTS[route]["request"]["sends"]), route


@pytest.mark.parametrize("asked", [{}, {"include": ["reasoning.encrypted_content"]}])
def test_what_the_gateway_adds_to_a_responses_request_is_recorded_with_vllms_type(asked):
    body = {"model": BASE_MODEL, "input": "hi", **asked}
    upstream, wants = responses_ids.prepare(body, ask_token_ids=True, ask_logprobs=True)
    assert not wants.token_ids and not wants.logprobs
    sends = ENDPOINTS[ROUTE[RESPONSES]]["request"]["sends"]
    added = {k for k in upstream if upstream[k] != body.get(k)}
    assert added == {"enable_response_messages", "include"} == set(sends)
    for name in added:
        vllm_type = sends[name].split(": ", 1)[1].split(" | ")[0]
        assert type(upstream[name]).__name__ == vllm_type.split("[")[0], f"{name}: vLLM's is {sends[name]}"
    assert upstream["include"] == [*asked.get("include", []), responses_ids.LOGPROBS]
    assert repr(responses_ids.LOGPROBS) in sends["include"]  # one of vLLM's literals


def test_the_extras_the_gateway_strips_are_recorded():
    chat, completions = _recorded(ROUTE[CHAT], "response"), _recorded(ROUTE[COMPLETIONS], "response")
    for key in openai_format._TOP_EXTRAS:
        assert key in chat, f"top-level {key} is stripped but not recorded"
    for key in openai_format._CHOICE_EXTRAS:
        path = f"choices[].{key}"
        assert path in chat or path in completions, f"{path} is stripped but not recorded"


def _keys_read(file: str, name: str) -> set[str]:
    """The string keys ``name`` reads with ``x.get("k")`` or ``x["k"]`` from dicts not its own."""
    tree = ast.parse((ROOT / file).read_text(encoding="utf-8"))
    cls, _, func = name.rpartition(".")
    scope: list[ast.stmt] = tree.body
    if cls:
        scope = next(n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func)
    keys: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.For) and isinstance(sub.iter, ast.Tuple):  # for key in ("id", ...)
            keys |= {
                e.value for e in sub.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
            }
        if (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr == "get"
            and sub.args
            and isinstance(sub.args[0], ast.Constant)
        ):
            receiver, key = sub.func.value, sub.args[0].value
        elif (
            isinstance(sub, ast.Subscript)
            and isinstance(sub.ctx, ast.Load)
            and isinstance(sub.slice, ast.Constant)
        ):
            receiver, key = sub.value, sub.slice.value
        else:
            continue
        root = receiver
        while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
            root = root.func if isinstance(root, ast.Call) else root.value
        if isinstance(key, str) and not (isinstance(root, ast.Name) and root.id in OWN):
            keys.add(key)
    return keys


def test_every_key_the_gateway_reads_from_an_answer_is_recorded():
    """Adding a read of a new upstream field fails here until the shapes record it."""
    recorded = {
        part.removesuffix("[]")
        for entry in ENDPOINTS.values()
        for kind in ("response", "stream")
        if kind in entry
        for path in entry[kind]["reads"]
        for part in path.split(".")
    } | set(_fields("ErrorResponse"))
    read = {(f, n): _keys_read(f, n) for f, n in READERS}
    assert read[("agentbolt/server/openai_format.py", "extract")] >= {"prompt_token_ids", "token_ids"}
    unrecorded = {
        (f"{file}:{name}", key)
        for (file, name), keys in read.items()
        for key in keys - recorded - NOT_FROM_VLLM - OPENAI_OUTPUT_ITEMS
    }
    assert not unrecorded, f"read from an upstream's answer but not in the vLLM shapes: {sorted(unrecorded)}"


def test_the_weight_sync_sends_only_recorded_lora_fields_and_vllm_takes_them(double, tmp_path):
    adapter = tmp_path / "step-00001"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    policy = RemotePolicy(double.base_url, BASE_MODEL, "/models/base", tmp_path)
    name = policy.sync(None, 1, saved=adapter)  # type: ignore[arg-type]  # saved: the model is not read
    (seen,) = [c for c in double.calls if c.path == "/v1/load_lora_adapter"]
    sends = ENDPOINTS[LORA]["request"]["sends"]
    assert set(seen.body) == set(sends)
    fields = SHAPES["request_models"]["LoadLoRAAdapterRequest"]["fields"]
    for key, value in seen.body.items():
        assert type(value).__name__ == fields[key], f"{key}={value!r}; vLLM's field is {fields[key]}"
    models = httpx.get(f"{double.base_url}/models", timeout=10).json()
    assert name in [card["id"] for card in models["data"]]


# ---------------------------------------------------------------- (b) the double's answers


def test_the_double_answers_chat_with_vllms_shapes(double):
    answers = [_ask(double, CHAT, body).json() for body in (CHAT_TEXT, CHAT_TOOL)]
    _check_answer(answers, ROUTE[CHAT], "response", absent_ok={"prompt_text"})
    prompt_ids, records = extract(CHAT, answers[0])
    assert prompt_ids and records[0]["token_ids"] and records[0]["logprobs"]


def test_the_double_streams_chat_with_vllms_shapes(double):
    chunks = [
        c for body in (CHAT_TEXT, CHAT_TOOL) for c in _sse(_ask(double, CHAT, {**body, "stream": True}))
    ]
    _check_answer(chunks, ROUTE[CHAT], "stream", absent_ok={"system_fingerprint"})
    assembler = StreamAssembler(CHAT)
    for chunk in _sse(_ask(double, CHAT, {**CHAT_TEXT, "stream": True})):
        assembler.add(chunk)
    assert assembler.response() | {"id": None} == _ask(double, CHAT, CHAT_TEXT).json() | {"id": None}


def test_the_double_answers_completions_with_vllms_shapes(double):
    answer = _ask(double, COMPLETIONS, COMPLETION).json()
    _check_answer([answer], ROUTE[COMPLETIONS], "response", absent_ok=set())
    chunks = _sse(_ask(double, COMPLETIONS, {**COMPLETION, "stream": True}))
    _check_answer(chunks, ROUTE[COMPLETIONS], "stream", absent_ok={"system_fingerprint"})
    prompt_ids, records = extract(COMPLETIONS, answer)
    assert prompt_ids and records[0]["token_ids"] and records[0]["logprobs"]


def test_the_double_answers_responses_and_models_with_vllms_shapes(double):
    body = {"model": BASE_MODEL, "input": "hi"}
    asked, _ = responses_ids.prepare(body, ask_token_ids=True, ask_logprobs=True)
    double.serves_responses = True
    try:
        plain = httpx.post(f"{double.base_url}/responses", json=body, timeout=10).json()
        answer = httpx.post(f"{double.base_url}/responses", json=asked, timeout=10).json()
        events = _sse(httpx.post(f"{double.base_url}/responses", json={**asked, "stream": True}, timeout=10))
    finally:
        double.serves_responses = False
    (final,) = [e for e in events if e["type"] == "response.completed"]
    # the event's own fields (type, sequence_number) are the openai package's: only its body is checked
    _check_answer([answer, final["response"]], ROUTE[RESPONSES], "response", absent_ok=set())
    for path in ENDPOINTS[ROUTE[RESPONSES]]["stream"]["reads"]:
        assert _at(final, path), f"the final event lacks {path}"
    prompt_ids, token_ids, logprobs = responses_ids.recorded_ids(answer)
    assert prompt_ids and token_ids and logprobs and len(logprobs) == len(token_ids)
    assert responses_ids.recorded_ids(final["response"]) == (prompt_ids, token_ids, logprobs)
    # not asked: vLLM's fields are there, null (the gateway strips its asks back to this)
    assert plain["input_messages"] is plain["output_messages"] is plain["top_logprobs"] is None
    assert plain["output"][0]["content"][0]["logprobs"] is None
    stripped = responses_ids.strip(answer, responses_ids.prepare(body, False, False)[1])
    assert stripped == plain
    models = httpx.get(f"{double.base_url}/models", timeout=10).json()
    _check_answer([models], "GET /v1/models", "response", absent_ok=set())


def test_the_double_errors_as_vllm_does(double):
    double.fail_next.append(500)
    answer = httpx.post(f"{double.base_url}/chat/completions", json=CHAT_TEXT, timeout=10)
    assert answer.status_code == 500
    assert set(answer.json()) == set(_fields("ErrorResponse"))
    assert set(answer.json()["error"]) == set(_fields("ErrorInfo"))


# ---------------------------------------------------------------- (c) what the double accepts


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_the_double_ignores_unknown_request_fields_as_vllm_does(double, endpoint):
    assert ENDPOINTS[ROUTE[endpoint]]["request"]["extra"] == "allow"  # kept, never an error
    body = CHAT_TEXT if endpoint == CHAT else COMPLETION
    plain = _ask(double, endpoint, body).json()
    assert _ask(double, endpoint, {**body, "not_a_vllm_field": 1}).json() == plain


def test_the_double_loads_and_unloads_lora_adapters_as_vllm_does(double, tmp_path):
    fields = SHAPES["request_models"]["LoadLoRAAdapterRequest"]["fields"]
    assert SHAPES["request_models"]["LoadLoRAAdapterRequest"]["extra"] == "ignore"
    (tmp_path / "adapter_config.json").write_text("{}")
    url = double.base_url.removesuffix("/v1")
    every = {"lora_name": "a", "lora_path": str(tmp_path), "load_inplace": False, "is_3d_lora_weight": False}
    assert set(every) == set(fields)  # every field vLLM's request model has

    def load(**body: Any) -> httpx.Response:
        return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=10)

    ok = load(**every, not_a_vllm_field=1)
    assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 'a' added successfully."
    assert load(**every).status_code == 400  # already loaded
    assert load(**{**every, "load_inplace": True}).status_code == 200
    assert load(lora_name="b").status_code == 400
    assert load(lora_name=BASE_MODEL, lora_path=str(tmp_path)).status_code == 400
    assert load(lora_name="c", lora_path=str(tmp_path / "none")).status_code == 404
    unload = SHAPES["request_models"]["UnloadLoRAAdapterRequest"]["fields"]
    assert set(unload) == {"lora_name", "lora_int_id"}
    gone = httpx.post(
        f"{url}/v1/unload_lora_adapter", json={"lora_name": "a", "lora_int_id": None}, timeout=10
    )
    assert gone.status_code == 200 and "a" not in double.adapters
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=10).status_code == 404


# ---------------------------------------------------------------- the embedded engine, vLLM-style

# What the embedded engine adds to vLLM's shapes (documented in agentbolt/engine/responses.py):
# the weights that served the call, and, for completions, the prompt ids at the top level too.
ENGINE_EXTRAS = {
    ("POST /v1/chat/completions", ""): {"model_version", "model_version_mixed"},
    ("POST /v1/completions", ""): {"model_version", "model_version_mixed", "prompt_token_ids"},
}


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_the_embedded_engine_answers_with_vllms_shapes(tmp_path, endpoint):
    """The engine server stands in for vLLM where a real model is needed (GRPO's remote test):
    the paths the gateway reads are where vLLM puts them, and it adds only its documented extras."""
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from engine_helpers import make_engine

    from agentbolt.engine import EngineServer, tiny_model_dir

    engine = make_engine(tiny_model_dir(tmp_path))
    body = {**(CHAT_TEXT if endpoint == CHAT else COMPLETION), "model": "tiny", "max_tokens": 3}
    path = "chat/completions" if endpoint == CHAT else "completions"
    route = ROUTE[endpoint]
    try:
        with EngineServer(engine) as server:
            answers = {}
            for kind, stream in (("response", False), ("stream", True)):
                upstream, _ = prepare(endpoint, {**body, "stream": stream}, ask_token_ids=True)
                answer = httpx.post(f"{server.base_url}/{path}", json=upstream, timeout=60)
                assert answer.status_code == 200, answer.text
                answers[kind] = _sse(answer) if stream else [answer.json()]
    finally:
        engine.close()
    for kind, bodies in answers.items():
        shape = ENDPOINTS[route][kind]
        for answer in bodies:
            for place, model, value in _places(answer, shape["models"]):
                extra = set(value) - set(_fields(model)) - ENGINE_EXTRAS.get((route, place), set())
                assert not extra, (
                    f"the engine sends {sorted(extra)} at {place!r} of {route}; {model} has none"
                )
        for read in ("choices[].token_ids", "choices[].logprobs"):
            assert any(_at(answer, read) for answer in bodies), f"{route} {kind}: no {read}"
        prompt = "prompt_token_ids" if endpoint == CHAT else "choices[].prompt_token_ids"
        assert any(_at(answer, prompt) for answer in bodies), f"{route} {kind}: no {prompt}"
