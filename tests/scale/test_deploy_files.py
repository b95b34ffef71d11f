"""The deployment examples cannot run here (no Docker, no cluster, no GPU), but they must at
least parse, and say the things the server depends on."""

from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY = Path(__file__).parents[2] / "deploy"


def test_compose_file_parses_and_keeps_secrets_out_of_commands():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    server = compose["services"]["server"]
    assert server["deploy"]["replicas"] > 1 and "FORWARDED_ALLOW_IPS" in server["environment"]
    assert "PGPASSWORD}" not in server["command"] and "TOKEN" not in server["command"]
    assert "--enable-lora" in compose["services"]["vllm"]["command"]


def test_kubernetes_manifests_parse():
    kinds = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert all("apiVersion" in d and "kind" in d for d in docs), path
        kinds += [d["kind"] for d in docs]
    assert {"Deployment", "Service", "Ingress", "Secret", "NetworkPolicy", "Job"} <= set(kinds)
