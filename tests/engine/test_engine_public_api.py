"""The names other packages rely on."""

import inspect

import agentbolt.engine as engine


def test_public_names() -> None:
    assert len(engine.__all__) == len(set(engine.__all__))
    for name in engine.__all__:
        assert hasattr(engine, name), name
    expected = {"ModelEngine", "EngineServer", "create_engine_app", "ensure_model", "tiny_model_dir"}
    assert expected <= set(engine.__all__)


def test_contract_signatures() -> None:
    params = inspect.signature(engine.ModelEngine.from_pretrained).parameters
    assert (
        list(params)[:3] == ["path_or_name", "device", "dtype"]
        and params["path_or_name"].default == "smollm2"
    )
    update = inspect.signature(engine.ModelEngine.update_weights).parameters
    assert {"state_dict", "adapter_path", "version"} <= set(update)
    assert inspect.iscoroutinefunction(engine.ModelEngine.chat)
    assert inspect.iscoroutinefunction(engine.ModelEngine.complete)
    from agentbolt.cli.model import model_app

    assert {c.name or c.callback.__name__ for c in model_app.registered_commands} == {"pull", "serve"}
