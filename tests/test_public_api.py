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
