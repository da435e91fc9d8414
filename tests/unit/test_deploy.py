"""deploy/: the Kubernetes manifest is consistent with itself, with the image of deploy/Dockerfile
and with pdserve's own command-line parsers (no cluster or image build here)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pdserve.config import ServerArgs
from pdserve.models.demo import DEMO_MODELS
from pdserve.router.args import parse_args as parse_router_args
from pdserve.server.launch import build_parser as server_parser

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.fixture(scope="module")
def manifest() -> dict[tuple[str, str], dict]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "pdserve-1p1d.yaml").read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.fixture(scope="module")
def dockerfile() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    return [ln.strip() for ln in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if ln.strip()]


def container(manifest, name: str) -> dict:
    (c,) = manifest[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    return c


def container_env(manifest, c: dict) -> dict[str, str]:
    """The container's environment, its secret references resolved from the Secret."""
    secret = manifest[("Secret", "pdserve-secrets")]["stringData"]
    return {e["name"]: secret[e["valueFrom"]["secretKeyRef"]["key"]] for e in c.get("env", [])}


def resolved_args(manifest, c: dict) -> list[str]:
    """The container's arguments with ``$(VAR)`` replaced as Kubernetes does."""
    env = container_env(manifest, c)
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(a)) for a in c["args"]]


def test_objects_and_selectors(manifest):
    assert set(manifest) == {("Secret", "pdserve-secrets")} | {
        (kind, f"pdserve-{role}")
        for kind in ("Deployment", "Service")
        for role in ("prefill", "decode", "router")
    }
    for role in ("prefill", "decode", "router"):
        dep, svc = (
            manifest[("Deployment", f"pdserve-{role}")],
            manifest[("Service", f"pdserve-{role}")],
        )
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"] == labels == svc["spec"]["selector"]
        assert dep["spec"]["replicas"] == 1
        named_ports = {p["name"] for p in container(manifest, f"pdserve-{role}")["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named_ports


def test_probes_resources_and_secrets(manifest):
    secret_keys = set(manifest[("Secret", "pdserve-secrets")]["stringData"])
    assert secret_keys == {"disaggregation-secret", "api-key"}
    for role in ("prefill", "decode", "router"):
        c = container(manifest, f"pdserve-{role}")
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert "livenessProbe" in c
        if role != "router":  # the router's /health reports its workers: a restart would not help
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            assert c["startupProbe"]["httpGet"]["path"] == "/health"
        assert {"cpu", "memory"} <= set(c["resources"]["requests"])
        refs = {e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"]}
        assert refs <= secret_keys and "api-key" in refs
        if role != "router":
            assert {e["name"] for e in c["env"]} >= {"PDSERVE_DISAGGREGATION_SECRET"}


def test_server_args_parse_and_match_the_services(manifest, monkeypatch):
    secrets = manifest[("Secret", "pdserve-secrets")]["stringData"]
    servers = {}
    for role in ("prefill", "decode"):
        c = container(manifest, f"pdserve-{role}")
        for name, value in container_env(manifest, c).items():
            monkeypatch.setenv(name, value)
        args = resolved_args(manifest, c)
        assert args[0] == "serve"
        servers[role] = sa = ServerArgs.from_cli_args(server_parser().parse_args(args[1:]))
        assert sa.disaggregation_mode == role
        assert sa.disaggregation_secret == secrets["disaggregation-secret"]
        assert sa.api_key == secrets["api-key"]
        assert sa.disaggregation_transfer_backend != "local"  # the two pods are two hosts
        assert sa.host == "0.0.0.0"
        assert sa.served_model_name == DEMO_MODELS[0]
        ports = {
            p["name"]: p["containerPort"] for p in container(manifest, f"pdserve-{role}")["ports"]
        }
        assert ports["http"] == sa.port
    prefill_ports = {
        p["name"]: p["port"] for p in manifest[("Service", "pdserve-prefill")]["spec"]["ports"]
    }
    assert prefill_ports["bootstrap"] == servers["prefill"].disaggregation_bootstrap_port

    monkeypatch.delenv("PDSERVE_API_KEY")
    c = container(manifest, "pdserve-router")
    for name, value in container_env(manifest, c).items():
        monkeypatch.setenv(name, value)
    router = parse_router_args(resolved_args(manifest, c)[1:])
    assert router.api_key == router.worker_api_key == secrets["api-key"]  # the servers' key too
    decode_port = manifest[("Service", "pdserve-decode")]["spec"]["ports"][0]["port"]
    # scalable: the router follows the headless Services' pods through DNS
    assert router.prefill == router.decode == [] and router.pd_mode
    assert router.prefill_dns == [
        ("pdserve-prefill", prefill_ports["http"], prefill_ports["bootstrap"])
    ]
    assert router.decode_dns == [("pdserve-decode", decode_port)]
    for role in ("prefill", "decode"):
        assert manifest[("Service", f"pdserve-{role}")]["spec"]["clusterIP"] == "None"
        pod = manifest[("Deployment", f"pdserve-{role}")]["spec"]["template"]["spec"]
        assert router.drain_timeout + 2 * router.dns_interval < pod["terminationGracePeriodSeconds"]
    router_port = manifest[("Service", "pdserve-router")]["spec"]["ports"][0]["port"]
    assert router.port == router_port


def test_image_has_what_the_manifest_runs(manifest, dockerfile):
    assert dockerfile[0].startswith("FROM python:")
    runs = " ".join(ln[4:] for ln in dockerfile if ln.startswith("RUN "))
    torch_install = next(shlex.split(cmd) for cmd in runs.split("&&") if "torch==" in cmd)
    assert "torch==2.13.0" in torch_install
    assert "https://download.pytorch.org/whl/cpu" in torch_install
    assert f"pdserve prepare-model {DEMO_MODELS[0]}" in runs
    env = " ".join(ln for ln in dockerfile if ln.startswith("ENV "))
    cache = re.search(r"PDSERVE_CACHE=(\S+)", env).group(1)
    for role in ("prefill", "decode"):
        args = container(manifest, f"pdserve-{role}")["args"]
        # where `pdserve prepare-model` puts the demo model (pdserve.models.demo.demo_model_dir)
        assert args[args.index("--model-path") + 1] == f"{cache}/models/{DEMO_MODELS[0]}"
        assert (
            container(manifest, f"pdserve-{role}")["image"]
            == container(manifest, "pdserve-router")["image"]
        )
    exposed = {int(p) for ln in dockerfile if ln.startswith("EXPOSE ") for p in ln.split()[1:]}
    used = {
        p["containerPort"]
        for role in ("prefill", "decode", "router")
        for p in container(manifest, f"pdserve-{role}")["ports"]
    }
    assert used <= exposed


def test_pre_stop_waits_on_metrics_the_server_exports(manifest):
    """The servers' preStop hook is Python that polls gauges the server really has."""
    from pdserve.server.metrics import ServerMetrics

    exported = [m.name for m in ServerMetrics("m").registry.collect()]
    for role in ("prefill", "decode"):
        command = container(manifest, f"pdserve-{role}")["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["python", "-c"]
        code = command[2]
        compile(code, "preStop", "exec")
        prefixes = re.findall(r"'(pdserve:[a-z_]+)'", code)
        assert prefixes and all(any(name.startswith(p) for name in exported) for p in prefixes), (
            prefixes
        )
