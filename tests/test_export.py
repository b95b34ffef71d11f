from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from typer.testing import CliRunner

from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.export import CARD_MARKER, dedupe, export_dataset, export_model, resolve_weights
from agentbolt.schemas import AttemptStatus, EventCreate, Mode, ModelWeights, RolloutCreate, Task

# ---------------------------------------------------------------------------- the OpenAI line format
# Written from OpenAI's documentation of the chat fine-tuning file format (one JSON object a line),
# independently of the exporter, so the test checks the exporter against the format, not itself.


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Function(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        assert isinstance(json.loads(value), dict), "arguments must be a JSON object string"
        return value


class _ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: _Function


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class _System(_Strict):
    role: Literal["system", "developer"]
    content: str | list[_TextPart]
    name: str | None = None


class _User(_Strict):
    role: Literal["user"]
    content: str | list[_TextPart]
    name: str | None = None


class _Assistant(_Strict):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[_ToolCall] | None = Field(default=None, min_length=1)
    name: str | None = None
    weight: Literal[0, 1] | None = None

    @model_validator(mode="after")
    def _says_something(self) -> _Assistant:
        assert self.content is not None or self.tool_calls, "an assistant message needs content or tool_calls"
        return self


class _ToolMessage(_Strict):
    role: Literal["tool"]
    content: str
    tool_call_id: str


class _FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _ToolDef(_Strict):
    type: Literal["function"]
    function: _FunctionDef


Message = Annotated[_System | _User | _Assistant | _ToolMessage, Field(discriminator="role")]


class OpenAIChatLine(_Strict):
    messages: list[Message] = Field(min_length=1)
    tools: list[_ToolDef] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> OpenAIChatLine:
        assert any(isinstance(m, _Assistant) for m in self.messages), "no assistant message to train on"
        call_ids: set[str] = set()
        for m in self.messages:
            if isinstance(m, _Assistant):
                call_ids |= {c.id for c in m.tool_calls or []}
            if isinstance(m, _ToolMessage):
                assert m.tool_call_id in call_ids, f"tool message answers unknown call {m.tool_call_id}"
        return self


# ---------------------------------------------------------------------------- stored runs

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "12+30"}'},
}


def tool_conversation(question: str, answer: str, ids: tuple[int, ...]) -> list[dict[str, Any]]:
    """Two llm_call events (docs/events.md shape): a tool call, then the answer after the tool output."""
    first = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": question}]
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    second = [*first, tool_turn, {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    p1, c1, tool_ids, c2 = [1, 2, ids[0]], [10, 11], [20, 21], [12, ids[1]]
    return [
        _llm_call(first, p1, c1, {"role": "assistant", "content": None, "tool_calls": [CALL]}),
        _llm_call(second, p1 + c1 + tool_ids, c2, {"role": "assistant", "content": answer}),
    ]


def _llm_call(
    messages: list[dict], prompt: list[int], completion: list[int], message: dict
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": "stop",
        "token_ids": completion,
        "logprobs": [-0.5] * len(completion),
    }
    return {
        "endpoint": "chat.completions",
        "request": {"model": "m", "messages": messages, "tools": TOOLS},
        "response": {},
        "stream": False,
        "prompt_token_ids": prompt,
        "choices": [choice],
        "model": "m",
        "resources_version": 1,
        "error": None,
    }


def store_run(
    client: Client,
    calls: list[dict],
    reward: float | None,
    mode: Mode = Mode.TRAIN,
    failed_first: list[dict] | None = None,
) -> str:
    """Enqueue a rollout, record ``calls`` as its llm_call events and finish it with ``reward``;
    with ``failed_first``, an earlier attempt records those calls and is given back (released:
    a failed attempt would fail the rollout at once)."""
    rollout = client.enqueue([RolloutCreate(task=Task(data={"q": "x"}), mode=mode, max_attempts=2)])[0]
    for events, status in ((failed_first, AttemptStatus.RELEASED), (calls, AttemptStatus.SUCCEEDED)):
        if events is None:
            continue
        claim = client.dequeue("w")
        assert claim is not None and claim.rollout.id == rollout.id
        client.add_events(claim.attempt.id, [EventCreate(type="llm_call", data=d) for d in events])
        client.finish(claim.attempt.id, status, reward=reward if status == AttemptStatus.SUCCEEDED else None)
    return rollout.id


@pytest.fixture
def runs(client: Client) -> Client:
    store_run(client, tool_conversation("12+30?", "42", (3, 4)), 1.0)
    store_run(client, tool_conversation("12+30?", "42", (3, 4)), 0.9)  # the same conversation again
    store_run(
        client,
        tool_conversation("6*7?", "It is 42.", (5, 6)),
        0.8,
        failed_first=tool_conversation("6*7?", "wrong", (7, 8)),
    )
    store_run(client, tool_conversation("1+1?", "3", (9, 9)), 0.1)  # below the threshold
    store_run(client, tool_conversation("2+2?", "4", (8, 8)), 1.0, mode=Mode.VAL)  # not train
    return client


# ---------------------------------------------------------------------------- datasets


def test_openai_export_validates_against_the_format_and_dedupes(runs: Client, tmp_path: Path) -> None:
    out = tmp_path / "data" / "sft.jsonl"
    summary = export_dataset(runs, out, "openai", min_reward=0.5)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    for line in lines:
        OpenAIChatLine.model_validate(line)
    assert (summary.rollouts, summary.rollouts_used, summary.rows, summary.duplicates) == (3, 2, 2, 1)
    answers = [line["messages"][-1]["content"] for line in lines]
    assert answers == ["42", "It is 42."]  # the failed first attempt ("wrong") is not exported
    assert [m["role"] for m in lines[0]["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert lines[0]["messages"][2]["tool_calls"] == [CALL] and lines[0]["tools"] == TOOLS


def test_openai_schema_rejects_malformed_lines() -> None:
    with pytest.raises(ValueError):
        OpenAIChatLine.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(ValueError):
        OpenAIChatLine.model_validate({"messages": [{"role": "assistant", "content": "x"}], "extra": 1})
    with pytest.raises(ValueError):
        OpenAIChatLine.model_validate(
            {
                "messages": [
                    {"role": "tool", "content": "42", "tool_call_id": "c9"},
                    {"role": "assistant", "content": "x"},
                ]
            }
        )


def test_hf_export_loads_back_with_datasets(runs: Client, tmp_path: Path) -> None:
    from datasets import load_from_disk

    out = tmp_path / "hf"
    summary = export_dataset(runs, out, "hf", min_reward=0.5)
    ds = load_from_disk(str(out))
    assert len(ds) == summary.rows == 2
    assert set(ds.column_names) == {
        "messages",
        "tools",
        "reward",
        "rollout_id",
        "task_id",
        "resources_version",
    }
    row = ds[0]
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert row["messages"][2]["tool_calls"] == [CALL] and row["messages"][3]["tool_call_id"] == "call_1"
    assert json.loads(row["tools"]) == TOOLS and row["reward"] == 1.0
    card = (out / "README.md").read_text()
    assert CARD_MARKER in card and "| rows | 2 |" in card


def test_token_export_keeps_gateway_ids_and_masks(runs: Client, tmp_path: Path) -> None:
    out = tmp_path / "tokens.jsonl"
    summary = export_dataset(runs, out, "tokens", min_reward=None, mode=None)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert summary.rollouts == 5 and summary.duplicates == 1 and len(lines) == 4
    first = lines[0]
    assert first["input_ids"] == [1, 2, 3, 10, 11, 20, 21, 12, 4]
    assert first["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert first["reward"] == 1.0 and first["resources_version"] is None
    assert all(len(x["input_ids"]) == len(x["loss_mask"]) for x in lines)


def test_card_reports_counts_rewards_and_versions(runs: Client, tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("my own notes")
    summary = export_dataset(runs, tmp_path / "a.jsonl", "openai", min_reward=0.5)
    assert (tmp_path / "README.md").read_text() == "my own notes"  # never overwritten
    assert summary.card == tmp_path / "a.jsonl.README.md"
    card = summary.card.read_text()
    for text in (
        "| rollouts matching the filters | 3 |",
        "| duplicate rows dropped | 1 |",
        "min 0.8",
        "max 1",
        "min_reward=0.5",
        "mode=train",
        "## Source resources versions",
    ):
        assert text in card, text
    first = export_dataset(runs, tmp_path / "sub" / "b.jsonl", "openai")
    second = export_dataset(runs, tmp_path / "sub" / "c.jsonl", "openai")
    again = export_dataset(runs, tmp_path / "sub" / "b.jsonl", "openai")
    assert first.card == again.card == tmp_path / "sub" / "README.md"
    assert second.card == tmp_path / "sub" / "c.jsonl.README.md"


def test_dedupe_keeps_the_first_of_equal_keys() -> None:
    seen: set[str] = {"z"}
    kept, dropped = dedupe(["a", "b", "a", "z", "c"], key=str, seen=seen)
    assert kept == ["a", "b", "c"] and dropped == 2 and seen == {"a", "b", "c", "z"}


def test_cli_exports_with_a_progress_bar(runs: Client, tmp_path: Path) -> None:
    from agentbolt.cli.export import export_app

    out = tmp_path / "cli.jsonl"
    args = ["sft", "--server", runs.url, "--format", "tokens", "--min-reward", "0.85", "--out", str(out)]
    result = CliRunner().invoke(export_app, args)
    assert result.exit_code == 0, result.output
    assert "wrote 1 rows from 1 of 2 rollouts (1 duplicates dropped" in " ".join(result.output.split())
    assert len(out.read_text().splitlines()) == 1


# ---------------------------------------------------------------------------- models


@pytest.fixture
def adapter(tmp_path: Path) -> tuple[Path, Path, torch.nn.Module]:
    """A tiny base model folder and a LoRA adapter trained-ish on it (random B, so it changes outputs)."""
    from transformers import AutoModelForCausalLM

    from agentbolt.algorithms.train_state import TrainConfig, export_weights, make_train_state
    from agentbolt.engine.testing import tiny_model_dir

    base = tiny_model_dir(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    state = make_train_state(model, TrainConfig(lora_r=4))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in state.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    path = tmp_path / "adapter"
    assert export_weights(state.model, path) == "lora"
    return base, path, state.model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_adapter_export_loads_with_peft(adapter: tuple[Path, Path, torch.nn.Module], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, path, trained = adapter
    out = export_model(resolve_weights(str(path)), tmp_path / "out")
    assert (out / "adapter_model.safetensors").is_file() and not list(out.glob("*.bin"))
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(out)
    )
    assert torch.allclose(_logits(loaded.eval()), _logits(trained), atol=1e-5)


def test_merged_export_is_a_plain_transformers_model(
    adapter: tuple[Path, Path, torch.nn.Module], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, path, trained = adapter
    out = export_model(ModelWeights(path=str(path), format="lora"), tmp_path / "merged", merge=True)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.allclose(_logits(merged), _logits(trained), atol=1e-4)
    assert AutoTokenizer.from_pretrained(out).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )


def test_cli_exports_the_weights_of_a_resources_version(
    client: Client, adapter: tuple[Path, Path, torch.nn.Module], tmp_path: Path
) -> None:
    from agentbolt.cli.export import export_app

    base, path, trained = adapter
    version = client.publish_resources(
        {"policy_weights": ModelWeights(path=str(path), base_model=str(base))}
    ).version
    out = tmp_path / "from-version"
    args = ["model", "--weights", str(version), "--out", str(out), "--merge", "--server", client.url]
    result = CliRunner().invoke(export_app, args)
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file()


def test_weights_that_are_not_on_disk_are_refused(client: Client, tmp_path: Path) -> None:
    version = client.publish_resources({"w": ModelWeights(path="engine://smollm2@3")}).version
    weights = resolve_weights(str(version), client)
    with pytest.raises(ConfigError, match="not a folder"):
        export_model(weights, tmp_path / "x")
    with pytest.raises(ConfigError, match="needs --server"):
        resolve_weights("3")
    with pytest.raises(ConfigError, match="neither a folder"):
        resolve_weights(str(tmp_path / "missing"))
