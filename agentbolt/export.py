"""Stored runs -> fine-tuning datasets, and trained weights -> Hugging Face model folders.

Datasets (``agentbolt export sft``) in three formats, built from the rollouts a server holds:

- ``openai``: OpenAI chat fine-tuning JSONL, one ``{"messages": [...], "tools": [...]?}`` per
  conversation (:func:`agentbolt.adapters.to_chat_rows`: tool calls and tool messages kept).
- ``hf``: a Hugging Face ``datasets`` dataset on disk (``save_to_disk``) of the same
  conversations. Every message has the same keys (``role``, ``content``, ``tool_calls``,
  ``tool_call_id``, ``name``; absent ones are null) and ``tools`` is a JSON string, because Arrow
  needs one schema per column and tool JSON schemas differ from row to row.
- ``tokens``: JSONL of the gateway's exact token ids, ``{"input_ids", "loss_mask", "reward", ...}``
  (:func:`agentbolt.adapters.to_trajectories`: 1 on model-generated tokens only).

Only the last attempt of each succeeded rollout is used (an earlier, failed try is not what
earned the reward). Identical rows are written once. A dataset card (``README.md``) beside the
data gives counts, the reward distribution and the resources versions the runs came from.

Models (``agentbolt export model``): a PEFT LoRA adapter copied as is, or merged into its base
model, or a full model, always written as safetensors that transformers and vLLM load.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentbolt.adapters import (
    AdapterStats,
    chat_row_key,
    latest_attempt,
    system_calls,
    to_chat_rows,
    to_trajectories,
)
from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.schemas import Event, EventType, Mode, ModelWeights, Rollout, RolloutStatus

__all__ = [
    "CARD_MARKER",
    "ExportFormat",
    "ExportSummary",
    "chat_rows",
    "dataset_card",
    "dedupe",
    "export_dataset",
    "export_model",
    "fetch_rollouts",
    "hf_row",
    "reward_summary",
    "resolve_weights",
    "token_rows",
    "write_rows",
]

ExportFormat = Literal["openai", "hf", "tokens"]
CARD_MARKER = "<!-- written by agentbolt export -->"
_PAGE = 1000


# ---------------------------------------------------------------------------- rows (pure)


def chat_rows(events: Sequence[Event]) -> list[dict[str, Any]]:
    """OpenAI chat fine-tuning lines of one rollout's last attempt."""
    return to_chat_rows(latest_attempt(events))


def token_rows(rollout: Rollout, events: Sequence[Event]) -> tuple[list[dict[str, Any]], AdapterStats]:
    """Token-id rows of one rollout's last attempt, with the rollout's reward and provenance."""
    rows, stats = to_trajectories(latest_attempt(events), reward=rollout.reward, task_id=rollout.task.id)
    out = [
        {
            "input_ids": list(r.input_ids),
            "loss_mask": list(r.loss_mask),
            "reward": r.reward,
            "rollout_id": r.rollout_id,
            "attempt_id": r.attempt_id,
            "segment_index": r.segment_index,
            "task_id": r.task_id,
            "resources_version": rollout.resources_version,
        }
        for r in rows
    ]
    return out, stats


def _text(content: Any) -> str | None:
    """Message content as one string (the text parts of a content list, joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return json.dumps(content)


def hf_row(row: dict[str, Any], rollout: Rollout) -> dict[str, Any]:
    """A chat row in one Arrow-friendly shape (see the module docstring)."""
    messages = [
        {
            "role": m["role"],
            "content": _text(m.get("content")),
            "tool_calls": m.get("tool_calls"),
            "tool_call_id": m.get("tool_call_id"),
            "name": m.get("name"),
        }
        for m in row["messages"]
    ]
    tools = json.dumps(row["tools"], sort_keys=True) if row.get("tools") else None
    return {
        "messages": messages,
        "tools": tools,
        "reward": rollout.reward,
        "rollout_id": rollout.id,
        "task_id": rollout.task.id,
        "resources_version": rollout.resources_version,
    }


def _token_key(row: dict[str, Any]) -> str:
    return json.dumps([row["input_ids"], row["loss_mask"]], separators=(",", ":"))


def dedupe(
    rows: Sequence[Any], key: Callable[[Any], str], seen: set[str] | None = None
) -> tuple[list[Any], int]:
    """Rows whose key was not seen before (``seen`` is updated), and how many were dropped."""
    seen = set() if seen is None else seen
    kept = []
    for row in rows:
        k = key(row)
        if k not in seen:
            seen.add(k)
            kept.append(row)
    return kept, len(rows) - len(kept)


# ---------------------------------------------------------------------------- summary and card


@dataclass
class ExportSummary:
    format: ExportFormat
    path: Path
    filters: dict[str, Any]
    rollouts: int = 0
    """Rollouts that matched the filters."""
    rollouts_used: int = 0
    """Of those, rollouts that gave at least one new row."""
    rows: int = 0
    duplicates: int = 0
    rewards: list[float] = field(default_factory=list)
    """Reward of each used rollout."""
    versions: Counter[int | None] = field(default_factory=Counter)
    """Rows per resources version."""
    adapter: AdapterStats = field(default_factory=AdapterStats)
    seconds: float = 0.0
    card: Path | None = None

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0


def reward_summary(rewards: Sequence[float]) -> dict[str, float]:
    if not rewards:
        return {}
    q = statistics.quantiles(rewards, n=4, method="inclusive") if len(rewards) > 1 else [rewards[0]] * 3
    return {
        "min": min(rewards),
        "p25": q[0],
        "median": q[1],
        "p75": q[2],
        "max": max(rewards),
        "mean": statistics.fmean(rewards),
    }


def _histogram(rewards: Sequence[float], bins: int = 5) -> list[tuple[str, int]]:
    low, high = min(rewards), max(rewards)
    if low == high:
        return [(f"{low:g}", len(rewards))]
    width = (high - low) / bins
    counts = Counter(min(int((r - low) / width), bins - 1) for r in rewards)
    return [
        (f"[{low + i * width:.3g}, {low + (i + 1) * width:.3g}{']' if i == bins - 1 else ')'}", counts[i])
        for i in range(bins)
    ]


def dataset_card(s: ExportSummary) -> str:
    """A short Markdown dataset card (Hugging Face style front matter)."""
    lines = [
        "---",
        "pretty_name: agentbolt SFT export",
        "tags: [agentbolt, sft, agents]",
        "---",
        CARD_MARKER,
        f"# Fine-tuning data exported by agentbolt ({s.format})",
        "",
        f"Written {time.strftime('%Y-%m-%d %H:%M:%S %Z')} to `{s.path.name}`.",
        "",
        "| | |",
        "|---|---|",
        f"| rollouts matching the filters | {s.rollouts} |",
        f"| rollouts used | {s.rollouts_used} |",
        f"| rows | {s.rows} |",
        f"| duplicate rows dropped | {s.duplicates} |",
        f"| model calls without token ids / failed | {s.adapter.skipped_no_ids} / {s.adapter.skipped_failed} |",
        "",
        "Filters: " + ", ".join(f"{k}={v}" for k, v in s.filters.items()),
        "",
        "## Reward",
        "",
    ]
    if s.rewards:
        lines += [
            " ".join(f"{k} {v:.4g}," for k, v in reward_summary(s.rewards).items()).rstrip(","),
            "",
            "| reward | rollouts |",
            "|---|---|",
        ]
        lines += [f"| {label} | {n} |" for label, n in _histogram(s.rewards)]
    else:
        lines.append("No rewarded rollouts.")
    lines += ["", "## Source resources versions", "", "| version | rows |", "|---|---|"]
    lines += [f"| {v if v is not None else '-'} | {n} |" for v, n in sorted(s.versions.items(), key=str)]
    return "\n".join(lines) + "\n"


def _card_path(out: Path, fmt: ExportFormat) -> Path:
    """README.md inside an HF dataset folder, else beside the file; never over a user's README
    or the card of another export (``<name>.README.md`` then)."""
    folder = out if fmt == "hf" else out.parent
    card = folder / "README.md"
    text = card.read_text(errors="replace") if card.exists() else None
    if text is not None and not (CARD_MARKER in text and f"`{out.name}`" in text):
        return folder / f"{out.name}.README.md"
    return card


# ---------------------------------------------------------------------------- writers


def write_rows(rows: Sequence[dict[str, Any]], out: Path, fmt: ExportFormat) -> None:
    """JSONL for ``openai``/``tokens``; ``datasets.Dataset.save_to_disk`` for ``hf``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        try:
            import datasets
        except ImportError as exc:
            raise ConfigError(f"the hf format needs `pip install 'agentbolt[export]'` ({exc})") from None
        was_on = datasets.is_progress_bar_enabled()  # our own bar is on screen
        datasets.disable_progress_bars()
        try:
            datasets.Dataset.from_list(list(rows)).save_to_disk(str(out))
        finally:
            if was_on:
                datasets.enable_progress_bars()
        return
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    tmp.replace(out)


# ---------------------------------------------------------------------------- from a server


def fetch_rollouts(
    client: Client, mode: Mode | None, version: int | None, min_reward: float | None
) -> list[Rollout]:
    """Succeeded rollouts matching the filters, oldest first."""
    succeeded = client.pages(
        client.list_rollouts,
        status=[RolloutStatus.SUCCEEDED],
        mode=mode,
        resources_version=version,
        limit=_PAGE,
    )
    return [r for r in succeeded if min_reward is None or (r.reward is not None and r.reward >= min_reward)]


def _with_events(client: Client, rollouts: Sequence[Rollout]) -> Iterator[tuple[Rollout, list[Event]]]:
    """Each rollout with its ``llm_call`` events, read for a page of rollouts at a time."""
    for start in range(0, len(rollouts), _PAGE):
        chunk = rollouts[start : start + _PAGE]
        events = client.events_of([r.id for r in chunk], type=[EventType.LLM_CALL.value])
        yield from ((r, events[r.id]) for r in chunk)


def _rows_of(
    rollout: Rollout, events: list[Event], fmt: ExportFormat
) -> tuple[list[dict], list[str], AdapterStats]:
    """(rows to write, their dedupe keys, adapter stats) for one rollout."""
    if fmt == "tokens":
        rows, stats = token_rows(rollout, events)
        return rows, [_token_key(r) for r in rows], stats
    chats = chat_rows(events)
    keys = [chat_row_key(r) for r in chats]
    rows = [hf_row(r, rollout) for r in chats] if fmt == "hf" else chats
    return rows, keys, AdapterStats(calls=len(system_calls(events)))


def export_dataset(
    client: Client,
    out: str | Path,
    fmt: ExportFormat = "openai",
    *,
    min_reward: float | None = None,
    mode: Mode | None = Mode.TRAIN,
    version: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ExportSummary:
    """Write the dataset and its card; ``progress(done, total)`` is called per rollout."""
    out = Path(out)
    filters = {"min_reward": min_reward, "mode": mode.value if mode else "all", "resources_version": version}
    summary = ExportSummary(format=fmt, path=out, filters=filters)
    started = time.perf_counter()
    rollouts = fetch_rollouts(client, mode, version, min_reward)
    summary.rollouts = len(rollouts)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for done, (rollout, events) in enumerate(_with_events(client, rollouts), 1):
        new, keys, stats = _rows_of(rollout, events, fmt)
        pairs, dropped = dedupe(list(zip(keys, new, strict=True)), key=lambda p: p[0], seen=seen)
        fresh = [row for _, row in pairs]
        _count(summary, rollout, fresh, dropped, stats)
        rows += fresh
        if progress:
            progress(done, len(rollouts))
    write_rows(rows, out, fmt)
    summary.seconds = time.perf_counter() - started
    summary.card = _card_path(out, fmt)
    summary.card.write_text(dataset_card(summary))
    return summary


def _count(s: ExportSummary, rollout: Rollout, fresh: list[dict], dropped: int, stats: AdapterStats) -> None:
    s.rows += len(fresh)
    s.duplicates += dropped
    s.adapter += stats
    s.versions[rollout.resources_version] += len(fresh)
    if fresh:
        s.rollouts_used += 1
        if rollout.reward is not None:
            s.rewards.append(rollout.reward)


# ---------------------------------------------------------------------------- models


def resolve_weights(spec: str, client: Client | None = None, resource: str | None = None) -> ModelWeights:
    """``spec`` is a folder (an adapter or a full model) or a resources version number on the
    server; ``resource`` names the :class:`ModelWeights` resource when a version holds several."""
    folder = Path(spec).expanduser()
    if folder.is_dir():
        fmt: Literal["lora", "full"] = "lora" if (folder / "adapter_config.json").is_file() else "full"
        return ModelWeights(path=str(folder), format=fmt)
    if not spec.isdigit():
        raise ConfigError(f"{spec} is neither a folder nor a resources version")
    if client is None:
        raise ConfigError(f"resources version {spec} needs --server")
    res = client.get_resources(int(spec))
    found = {n: r for n, r in res.resources.items() if isinstance(r, ModelWeights) and resource in (None, n)}
    if len(found) != 1:
        raise ConfigError(
            f"resources version {spec} holds {len(found)} model weights resources "
            f"({', '.join(found) or 'none'}); name one with --resource"
        )
    return next(iter(found.values()))


def export_model(
    weights: ModelWeights, out: str | Path, *, merge: bool = False, base_model: str | None = None
) -> Path:
    """Write ``weights`` to ``out`` as safetensors: the adapter, the merged model, or the full model."""
    src, out = Path(weights.path).expanduser(), Path(out)
    if "://" in weights.path or not src.is_dir():
        raise ConfigError(f"weights at {weights.path!r} are not a folder on this machine")
    if weights.format == "lora" and merge:
        return _merge_adapter(src, out, base_model or weights.base_model)
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.suffix not in (".bin", ".pt"):
            shutil.copy2(item, out / item.name)
    _bin_to_safetensors(src, out)
    return out


def _bin_to_safetensors(src: Path, out: Path) -> None:
    """A torch ``.bin`` state dict (older PEFT/transformers) rewritten as safetensors."""
    import torch
    from safetensors.torch import save_file

    for name in ("adapter_model.bin", "pytorch_model.bin"):
        if (src / name).is_file() and not (out / name.replace(".bin", ".safetensors")).exists():
            tensors = torch.load(src / name, map_location="cpu", weights_only=True)
            save_file(
                {k: v.contiguous() for k, v in tensors.items()}, out / name.replace(".bin", ".safetensors")
            )


def _merge_adapter(adapter: Path, out: Path, base_model: str | None) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentbolt.algorithms.train_state import export_weights, load_adapter, merge_lora
    from agentbolt.engine.model_files import ensure_model

    config = json.loads((adapter / "adapter_config.json").read_text())
    base_name = base_model or config.get("base_model_name_or_path")
    if not base_name:
        raise ConfigError(f"{adapter} does not name its base model; pass --base-model")
    base = ensure_model(base_name)
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    export_weights(merge_lora(load_adapter(model, adapter), in_place=True), out)
    AutoTokenizer.from_pretrained(base).save_pretrained(str(out))
    return out
