"""Issue 14: the Kubernetes manifests, rendered offline (``kubectl kustomize``; PyYAML where kubectl is
missing) and checked against the config they carry: every pod's role, config path, port and probes,
its drain time, its secrets, and the Services the router finds the nodes through."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from kvrelay.deploy.config import load_config
from kvrelay.deploy.config_checks import termination_grace_error
from kvrelay.deploy.up import GRACE_S

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def _documents() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        text = subprocess.run([kubectl, "kustomize", str(K8S)], check=True, capture_output=True, text=True,
                              timeout=60).stdout
    else:
        text = (K8S / "kvrelay.yaml").read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_every_pod_matches_the_config_it_mounts(tmp_path):
    docs = _documents()
    [config_map] = _by_kind(docs, "ConfigMap").values()
    path = tmp_path / "kvrelay.yaml"
    path.write_text(config_map["data"]["kvrelay.yaml"])
    config = load_config(path, gpu_free_bytes=lambda: 80 << 30)
    services = _by_kind(docs, "Service")
    workloads = {**_by_kind(docs, "StatefulSet"), **_by_kind(docs, "Deployment")}
    assert sorted(workloads) == ["kvrelay-decode", "kvrelay-prefill", "kvrelay-router"]

    ports = {"prefill": config.prefill.ports[0], "decode": config.decode.ports[0], "router": config.router.port}
    for name, workload in workloads.items():
        role = name.removeprefix("kvrelay-")
        pod = workload["spec"]["template"]["spec"]
        [container] = pod["containers"]
        assert container["image"] and "command" not in container  # the image's entry point is kvrelay
        args = container["args"]
        assert args[0] == role and args[args.index("--config") + 1] == "/etc/kvrelay/kvrelay.yaml"
        assert "--name" not in args  # a node is its pod: --name defaults to the host name
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert mounts["config"] == "/etc/kvrelay"
        assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
        assert config.model.path.startswith(mounts["models"] + "/")
        assert [p["containerPort"] for p in container["ports"]] == [ports[role]]
        env = {e["name"]: e for e in container["env"]}
        token = env["KVRELAY_INTERNAL_TOKEN"]
        assert "value" not in token and token["valueFrom"]["secretKeyRef"]["name"] == "kvrelay-secrets"
        assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
        ready, live = container["readinessProbe"], container["livenessProbe"]
        if role == "router":
            assert ready["httpGet"] == {"path": "/health", "port": ports[role]}
            assert live["tcpSocket"] == {"port": ports[role]}
            continue
        assert ready["httpGet"] == {"path": "/ready", "port": ports[role]}
        assert live["httpGet"] == {"path": "/health", "port": ports[role]}
        assert termination_grace_error(drain_timeout_s=config.internal.drain_timeout_s,
                                       persist_timeout_s=config.internal.persist_timeout_s,
                                       grace_period_s=pod["terminationGracePeriodSeconds"], margin_s=GRACE_S) is None
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        # The router finds these pods through their headless Service: one DNS address per ready pod.
        service = services[workload["spec"]["serviceName"]]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"] == workload["spec"]["template"]["metadata"]["labels"]
        assert [p["port"] for p in service["spec"]["ports"]] == [ports[role]]
        dns = config.router.prefill_dns if role == "prefill" else config.router.decode_dns
        assert dns == (f"{service['metadata']['name']}:{ports[role]}",)
    assert config.internal.bind == "0.0.0.0" and config.internal.drain_timeout_s == 30
    assert config.router.prefill_urls == () and config.router.decode_urls == ()
    router_service = services["kvrelay"]
    assert router_service["spec"]["selector"] == workloads["kvrelay-router"]["spec"]["template"]["metadata"]["labels"]
    assert router_service["spec"]["ports"][0]["targetPort"] == ports["router"]
