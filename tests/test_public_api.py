import sys

import pytest

import agentbolt


def test_all_names_exist_once():
    assert len(agentbolt.__all__) == len(set(agentbolt.__all__))
    for name in agentbolt.__all__:
        assert hasattr(agentbolt, name), name


def test_the_public_surface_is_what_users_need():
    expected = {
        "LitAgent",
        "Trajectory",
        "Task",
        "rollout",
        "emit_reward",
        "emit_message",
        "emit_tool_call",
        "Trainer",
        "Evaluate",
        "Runner",
        "Client",
        "PromptTemplate",
        "LLM",
        "ModelWeights",
    }
    assert expected <= set(agentbolt.__all__)
    assert not [n for n in agentbolt.__all__ if n.startswith("_")]


def test_every_public_name_resolves_to_what_its_module_defines():
    namespace: dict = {}
    exec("from agentbolt import *", namespace)
    assert set(agentbolt.__all__) <= set(namespace)
    for name in agentbolt.__all__:
        value = getattr(agentbolt, name)
        assert value is not None, name
        assert value is getattr(sys.modules[value.__module__], name), name
    assert set(agentbolt.__all__) <= set(dir(agentbolt))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        agentbolt.Nope  # noqa: B018
