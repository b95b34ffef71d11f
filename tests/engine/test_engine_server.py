"""The OpenAI-compatible HTTP server: the openai client, streaming, errors, weight-update routes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from engine_helpers import make_engine
from safetensors.torch import save_file

from agentbolt.engine import EngineServer, ModelEngine


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[EngineServer]:
    engine = make_engine(tiny_dir, strict_model_name=True)
    with EngineServer(engine) as srv:
        yield srv
    engine.close()


@pytest.fixture
def http(server: EngineServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


def test_base_url_and_models(server: EngineServer, http: httpx.Client) -> None:
    assert server.base_url.startswith("http://127.0.0.1:") and server.base_url.endswith("/v1")
    models = http.get("/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"


def test_openai_client_chat_with_vllm_fields(server: EngineServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    body = response.model_dump()
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 8 == len(choice["logprobs"]["content"])
    assert body["prompt_token_ids"] and body["model_version"] == 0
    assert choice["message"]["content"] == server.engine.tokenizer.decode(choice["token_ids"])


def test_completions_over_http(http: httpx.Client) -> None:
    body = http.post(
        "/completions",
        json={
            "model": "tiny",
            "prompt": ["Hello", "The"],
            "max_tokens": 4,
            "n": 2,
            "temperature": 0.7,
            "seed": 1,
        },
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(len(c["token_ids"]) <= 4 and c["prompt_token_ids"] for c in body["choices"])


def test_streaming_matches_the_plain_response(server: EngineServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    plain = client.chat.completions.create(**kwargs).model_dump()
    chunks = [c.model_dump() for c in client.chat.completions.create(stream=True, **kwargs)]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    ids = [i for c in chunks if c["choices"] for i in (c["choices"][0].get("token_ids") or [])]
    assert text == plain["choices"][0]["message"]["content"]
    assert ids == plain["choices"][0]["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]


def test_streamed_completions_match_the_plain_response(server: EngineServer, http: httpx.Client) -> None:
    """Two prompts x n=2, greedy with logprobs: each streamed choice joins up to the plain
    choice (text, token ids, logprobs, offsets, finish reason); the openai client parses it."""
    body = {
        "model": "tiny",
        "prompt": ["Hello", "The sky"],
        "n": 2,
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": 2,
        "ignore_eos": True,
    }
    plain = http.post("/completions", json=body).json()
    stream = openai.OpenAI(base_url=server.base_url, api_key="unused").completions.create(
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        **{k: v for k, v in body.items() if k != "ignore_eos"},
    )
    chunks = [c.model_dump() for c in stream]
    assert all(c["object"] == "text_completion" for c in chunks) and all(
        chunks[-1]["usage"][k] == v for k, v in plain["usage"].items()
    )
    for want in plain["choices"]:
        got = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == want["index"]]
        assert "".join(g["text"] for g in got) == want["text"]
        assert [i for g in got for i in (g.get("token_ids") or [])] == want["token_ids"]
        assert got[0]["prompt_token_ids"] == want["prompt_token_ids"]

        def joined(key: str, got: list = got) -> list:
            return [v for g in got if g["logprobs"] for v in g["logprobs"][key]]

        assert joined("tokens") == want["logprobs"]["tokens"]
        assert joined("text_offset") == want["logprobs"]["text_offset"]
        # batch companions differ between the two runs: float noise, not different tokens
        assert joined("token_logprobs") == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-3)
        assert len(joined("top_logprobs")) == len(want["token_ids"])
        assert got[-1]["finish_reason"] == want["finish_reason"] == "length"


def test_streamed_completion_with_echo_starts_with_the_prompt(http: httpx.Client) -> None:
    body = {
        "model": "tiny",
        "prompt": "Once",
        "max_tokens": 3,
        "temperature": 0,
        "echo": True,
        "stream": True,
    }
    with http.stream("POST", "/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    plain = http.post("/completions", json={**body, "stream": False}).json()["choices"][0]
    assert chunks[0]["choices"][0]["text"] == "Once"
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
    _error(http.post("/completions", json={"model": "tiny", "prompt": "", "stream": True}), 400)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny"}, "messages"),
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
            "max_tokens",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}, None),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}, None),
    ],
)
def test_malformed_chat_requests_get_openai_400s(http: httpx.Client, body: dict, param: str | None) -> None:
    error = _error(http.post("/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_other_errors(http: httpx.Client) -> None:
    _error(
        http.post("/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
        400,
    )
    _error(http.post("/chat/completions", json=[1, 2]), 400)
    missing = _error(
        http.post(
            "/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
        ),
        404,
    )
    assert missing["code"] == "model_not_found" and missing["param"] == "model"
    _error(http.post("/completions", json={"model": "tiny", "prompt": [99999]}), 400)
    _error(http.post("/completions", json={"model": "tiny", "prompt": "x", "echo": True, "logprobs": 1}), 400)
    _error(http.get("/nothing-here"), 404)
    _error(http.post("/load_lora_adapter", json={"lora_name": "x"}), 400)
    _error(http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/dir"}), 404)
    _error(http.post("/update_weights", json={"path": "/no/such/file.safetensors"}), 404)


def test_update_weights_route(server: EngineServer, http: httpx.Client, tmp_path: Path) -> None:
    engine: ModelEngine = server.engine
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    save_file(state, str(tmp_path / "same.safetensors"))
    before = engine.version
    reply = http.post(
        "/update_weights", json={"path": str(tmp_path / "same.safetensors"), "version": 42}
    ).json()
    assert reply == {"status": "ok", "model_version": 42} and before != 42
    body = http.post(
        "/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    ).json()
    assert body["model_version"] == 42 and body["system_fingerprint"] == "agentbolt-v42"


def test_stream_errors_before_the_stream_starts(http: httpx.Client) -> None:
    response = http.post("/chat/completions", json={"model": "tiny", "messages": [], "stream": True})
    _error(response, 400)
    with http.stream(
        "POST",
        "/chat/completions",
        json={
            "model": "tiny",
            "stream": True,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "x"}],
        },
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["object"] == "chat.completion.chunk"
