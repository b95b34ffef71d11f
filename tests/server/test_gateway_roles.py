"""The roles of a system of agents: with several LLM resources, each gets its own gateway URL
(``/gateway/<rollout>/<attempt>/role/<name>/v1``), and a call there with the role's model is
recorded as that role's: two roles on one model are told apart. A real server on
127.0.0.1, the real openai client, a real runner running a program agent; the model server is
the test double (tests/server/upstream_double.py)."""

from __future__ import annotations

import asyncio
import sys

import openai
import pytest

from agentbolt.runner.program import Program
from agentbolt.runner.worker import Runner
from agentbolt.schemas import LLM, RolloutCreate, RolloutStatus, Task


def _two_roles(rig) -> None:
    """``planner`` and ``solver``, both on the model ``double``: only the URL tells them apart."""
    same = {"base_url": rig.upstream.base_url, "model": "double"}
    rig.client.publish_resources({"planner": LLM(**same), "solver": LLM(**same)})


def _ask(llm: LLM, text: str) -> None:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": text}])


def test_each_role_has_its_url_and_its_calls_are_recorded_as_its_own(rig):
    _two_roles(rig)
    rig.client.enqueue([RolloutCreate(task=Task(data={"q": "hi"}))])
    claim = rig.client.dequeue("w1")
    assert claim is not None and claim.resources is not None
    llms = claim.resources.resources
    base = f"{rig.server.url}/gateway/{claim.rollout.id}/{claim.attempt.id}"
    assert llms["planner"].base_url == f"{base}/role/planner/v1"  # type: ignore[union-attr]
    assert llms["solver"].base_url == f"{base}/role/solver/v1"  # type: ignore[union-attr]
    _ask(llms["solver"], "solve")  # type: ignore[arg-type]
    _ask(llms["planner"], "plan")  # type: ignore[arg-type]
    with openai.OpenAI(base_url=llms["solver"].base_url, api_key=llms["solver"].api_key) as client:  # type: ignore[union-attr]
        listed = client.models.list()
    assert [m.id for m in listed.data] == ["double"]
    records = rig.llm_calls(claim.rollout.id)
    asked = [(r.data["resource"], r.data["request"]["messages"][0]["content"]) for r in records]
    assert asked == [("solver", "solve"), ("planner", "plan")]


def test_a_role_that_is_not_a_resource_is_a_404_naming_the_roles(rig):
    _two_roles(rig)
    rig.client.enqueue([RolloutCreate(task=Task(data={"q": "hi"}))])
    claim = rig.client.dequeue("w1")
    assert claim is not None and claim.resources is not None
    planner = claim.resources.resources["planner"]
    critic = planner.model_copy(
        update={"base_url": planner.base_url.replace("/role/planner/", "/role/critic/")}
    )  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError) as caught:
        _ask(critic, "judge")  # type: ignore[arg-type]
    assert "no role 'critic': planner (model 'double'), solver (model 'double')" in str(caught.value)
    assert rig.llm_calls(claim.rollout.id) == []  # nothing recorded, nothing sent
    assert rig.upstream.calls == []


PROGRAM = """
import os, openai
for role in ("PLANNER", "SOLVER"):
    client = openai.OpenAI(base_url=os.environ[f"AGENTBOLT_LLM_{role}_BASE_URL"], max_retries=0)
    model = os.environ[f"AGENTBOLT_LLM_{role}_MODEL"]
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": role}])
open(os.environ["AGENTBOLT_RESULT_FILE"], "w").write("1")
"""


def test_a_program_gets_one_url_per_role_in_variables_named_after_the_roles(rig, tmp_path):
    _two_roles(rig)
    script = tmp_path / "agent.py"
    script.write_text(PROGRAM)
    [ro] = rig.client.enqueue([RolloutCreate(task=Task(data={"q": "hi"}))])
    runner = Runner(Program([sys.executable, str(script)]), rig.server.url, max_rollouts=1, poll_wait=0.2)
    asyncio.run(asyncio.wait_for(runner.run(), 60))
    assert rig.client.get_rollout(ro.id).status == RolloutStatus.SUCCEEDED
    records = rig.llm_calls(ro.id)
    asked = [(r.data["resource"], r.data["request"]["messages"][0]["content"]) for r in records]
    assert asked == [("planner", "PLANNER"), ("solver", "SOLVER")]


def test_a_kubernetes_job_gets_the_roles_urls_on_the_public_address(rig):
    from agentbolt.runner.kube_launch import variables

    _two_roles(rig)
    rig.client.enqueue([RolloutCreate(task=Task(data={"q": "hi"}))])
    claim = rig.client.dequeue("w1")
    assert claim is not None
    env, _ = variables(claim, "http://agentbolt.svc:8765", "solver")
    base = f"http://agentbolt.svc:8765/gateway/{claim.rollout.id}/{claim.attempt.id}"
    assert env["AGENTBOLT_LLM_PLANNER_BASE_URL"] == f"{base}/role/planner/v1"
    assert env["AGENTBOLT_LLM_SOLVER_BASE_URL"] == env["OPENAI_BASE_URL"] == f"{base}/role/solver/v1"
    assert env["AGENTBOLT_LLM_PLANNER_MODEL"] == env["OPENAI_MODEL"] == "double"
