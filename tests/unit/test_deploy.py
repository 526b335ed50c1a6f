"""deploy/: the Dockerfile, compose file and Kubernetes manifests agree with each other and
with the real `tierps serve` command line."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierps.server import cli
from tierps.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"


# -- readers -------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def shard_services() -> dict[str, dict[str, Any]]:
    services = compose()["services"]
    shards = {name: s for name, s in services.items() if s.get("command", [None])[0] == "serve"}
    assert shards, "compose.yaml runs no `tierps serve`"
    return shards


def k8s_docs() -> dict[str, dict[str, Any]]:
    """Every manifest in deploy/k8s (not the kustomization), by kind."""
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None or doc["kind"] == "Kustomization":
                continue
            assert doc["kind"] not in docs, f"two {doc['kind']} manifests"
            docs[doc["kind"]] = doc
    return docs


def shard_container(statefulset: dict[str, Any]) -> dict[str, Any]:
    containers = statefulset["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def k8s_args(container: dict[str, Any], shard_id: int) -> list[str]:
    """The container's args as the kubelet expands them for pod ordinal shard_id."""
    values = {}
    for name, entry in env_of(container).items():
        if "value" in entry:
            values[name] = entry["value"]
        elif entry["valueFrom"].get("fieldRef", {}).get("fieldPath") == POD_INDEX:
            values[name] = str(shard_id)
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in container["args"]]
    assert not any("$(" in a for a in expanded), expanded
    return [str(a) for a in expanded]


def flag(args: list[str], name: str) -> str:
    """The value of a flag given exactly once."""
    args = [str(a) for a in args]
    assert args.count(name) == 1, f"{name} given {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of each instruction, continuation lines joined."""
    lines = [
        line
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if not line.lstrip().startswith("#")
    ]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def docker_exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def duration_s(text: str) -> float:
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", text)
    assert parts and text, f"not a compose duration: {text!r}"
    return int(parts.group(1) or 0) * 60 + int(parts.group(2) or 0)


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port in named, f"no container port named {port!r}"
    return named[port]


# -- compose -------------------------------------------------------------------------------


def test_compose_runs_each_shard_id_once_with_the_same_shard_count() -> None:
    services = shard_services()
    counts = {int(flag(s["command"], "--num-shards")) for s in services.values()}
    assert counts == {len(services)}
    ids = sorted(int(flag(s["command"], "--shard-id")) for s in services.values())
    assert ids == list(range(len(services)))
    assert len(services) >= 2


def test_compose_ports_bind_and_publish() -> None:
    published = []
    for name, service in shard_services().items():
        args = service["command"]
        assert flag(args, "--host") == "0.0.0.0", name
        targets = {int(p["target"]) for p in service["ports"]}
        assert int(flag(args, "--port")) in targets, name
        assert int(flag(args, "--metrics-port")) in targets, name
        for port in service["ports"]:
            assert port["host_ip"] == "127.0.0.1", f"{name} publishes beyond loopback"
            published.append(int(port["published"]))
    assert len(published) == len(set(published)), f"a host port published twice: {published}"


def test_compose_volumes_one_data_volume_per_shard_and_one_shared_snapshot_volume() -> None:
    declared = set(compose()["volumes"])
    data, snapshots = [], set()
    for name, service in shard_services().items():
        mounts = dict(reversed(v.split(":")[:2]) for v in service["volumes"])
        assert mounts[flag(service["command"], "--data-dir")] in declared, name
        data.append(mounts[flag(service["command"], "--data-dir")])
        snapshots.add(mounts[flag(service["command"], "--snapshot-dir")])
    assert len(set(data)) == len(data), f"shards share a data volume: {data}"
    assert len(snapshots) == 1 and snapshots <= declared
    assert not snapshots & set(data)


def test_compose_stops_gracefully_and_checks_health() -> None:
    for name, service in shard_services().items():
        assert service.get("stop_signal", "SIGTERM") == "SIGTERM", name
        assert duration_s(service["stop_grace_period"]) >= 15, name
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"], name
        assert f"127.0.0.1:{flag(service['command'], '--health-port')}" in test[3], name
        assert "SERVING" in test[3]
        compile(test[3], "healthcheck", "exec")


def test_compose_builds_this_dockerfile_from_the_repo_root() -> None:
    for name, service in shard_services().items():
        build = service["build"]
        context = (DEPLOY / build["context"]).resolve()
        assert context == ROOT, name
        assert (context / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile", name


# -- kubernetes ----------------------------------------------------------------------------


def test_statefulset_shard_count_and_ids() -> None:
    docs = k8s_docs()
    sts = docs["StatefulSet"]
    container = shard_container(sts)
    env = env_of(container)
    replicas = sts["spec"]["replicas"]
    assert int(env["NUM_SHARDS"]["value"]) == replicas
    assert flag(container["args"], "--num-shards") == "$(NUM_SHARDS)"
    assert flag(container["args"], "--shard-id") == "$(SHARD_ID)"
    assert env["SHARD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX
    for shard_id in range(replicas):
        args = k8s_args(container, shard_id)
        assert int(flag(args, "--shard-id")) == shard_id
        assert int(flag(args, "--num-shards")) == replicas
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == docs["Service"]["metadata"]["name"]
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 30


def test_headless_service_selects_the_shard_pods() -> None:
    docs = k8s_docs()
    service, sts = docs["Service"], docs["StatefulSet"]
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_k8s_grpc_port_agrees_everywhere() -> None:
    docs = k8s_docs()
    container = shard_container(docs["StatefulSet"])
    args = container["args"]
    assert flag(args, "--host") == "0.0.0.0"
    grpc_port = int(flag(args, "--port"))
    metrics_port = int(flag(args, "--metrics-port"))
    assert resolve_port("grpc", container) == grpc_port
    assert resolve_port("metrics", container) == metrics_port
    health_port = int(flag(args, "--health-port"))
    assert resolve_port("health", container) == health_port
    for probe in ("startupProbe", "readinessProbe"):  # gRPC probes cannot speak TLS
        assert container[probe]["grpc"]["port"] == health_port, probe
    liveness = container["livenessProbe"]
    action = liveness.get("grpc") or liveness["tcpSocket"]
    assert resolve_port(action["port"], container) == grpc_port
    service_ports = {p["name"]: p for p in docs["Service"]["spec"]["ports"]}
    assert set(service_ports) == {"grpc"}  # metrics are scraped per pod, health by kubelet
    assert service_ports["grpc"]["port"] == grpc_port
    assert resolve_port(service_ports["grpc"]["targetPort"], container) == grpc_port


def test_k8s_volumes() -> None:
    docs = k8s_docs()
    sts = docs["StatefulSet"]
    container = shard_container(sts)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    templates = {t["metadata"]["name"]: t for t in sts["spec"]["volumeClaimTemplates"]}
    data = templates[mounts[flag(container["args"], "--data-dir")]]
    assert data["spec"]["accessModes"] == ["ReadWriteOnce"]
    pod_volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    snapshot_volume = mounts[flag(container["args"], "--snapshot-dir")]
    assert snapshot_volume not in templates, "each shard would get its own snapshot dir"
    claim = pod_volumes[snapshot_volume]["persistentVolumeClaim"]["claimName"]
    pvc = docs["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == claim
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(manifests)


# -- Dockerfile ----------------------------------------------------------------------------


def test_dockerfile_image_ports_user_and_entrypoint() -> None:
    instructions = dockerfile()
    by_word: dict[str, list[str]] = {}
    for word, rest in instructions:
        by_word.setdefault(word, []).append(rest)
    assert by_word["FROM"] == ["python:3.11-slim"]
    exposed = {int(p.split("/")[0]) for rest in by_word["EXPOSE"] for p in rest.split()}
    container = shard_container(k8s_docs()["StatefulSet"])
    assert int(flag(container["args"], "--port")) in exposed
    assert int(flag(container["args"], "--metrics-port")) in exposed
    for service in shard_services().values():
        assert {int(p["target"]) for p in service["ports"]} <= exposed
    user = by_word["USER"][-1].split(":")[0]
    assert user not in {"root", "0"}
    assert [w for w, _ in instructions].index("USER") < [w for w, _ in instructions].index("CMD")
    assert docker_exec_form(by_word["ENTRYPOINT"][-1]) == ["tierps"]
    assert container["command"] == ["tierps"]
    cmd = docker_exec_form(by_word["CMD"][-1])
    assert flag(cmd, "--host") == "0.0.0.0"
    assert int(flag(cmd, "--port")) in exposed
    assert any("pip install --no-cache-dir" in run for run in by_word["RUN"])
    for rest in by_word["COPY"]:
        for source in rest.split()[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repo"


# -- the real CLI --------------------------------------------------------------------------


def every_serve_command() -> list[tuple[str, list[str]]]:
    commands = [
        (f"compose {n}", [str(a) for a in s["command"]]) for n, s in shard_services().items()
    ]
    sts = k8s_docs()["StatefulSet"]
    container = shard_container(sts)
    for shard_id in range(sts["spec"]["replicas"]):
        commands.append((f"k8s pod {shard_id}", k8s_args(container, shard_id)))
    cmd = [rest for word, rest in dockerfile() if word == "CMD"][-1]
    commands.append(("Dockerfile CMD", docker_exec_form(cmd)))
    return commands


def test_every_serve_command_parses_with_the_real_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each container's args go through `tierps`'s own parser, and the flags make a valid
    ServerConfig (shard id in range, ports in range); nothing is served."""
    parsed: list[argparse.Namespace] = []

    def capture(args: argparse.Namespace) -> int:
        parsed.append(args)
        return 0

    monkeypatch.setattr(cli, "_serve", capture)
    with pytest.raises(SystemExit):  # the parser does reject what it does not know
        cli.main(["serve", "--shard-id", "0", "--no-such-flag"])
    for where, args in every_serve_command():
        assert args[0] == "serve", where
        assert cli.main(args) == 0, where
        ns = parsed[-1]
        secured = None not in (ns.tls_cert, ns.tls_key, ns.tls_client_ca, ns.tokens_file)
        assert secured or (where == "Dockerfile CMD" and ns.insecure), where
        config = ServerConfig(
            shard_id=ns.shard_id, num_shards=ns.num_shards, data_dir=ns.data_dir,
            snapshot_dir=ns.snapshot_dir, host=ns.host, port=ns.port,
            metrics_port=ns.metrics_port,
        )  # fmt: skip
        assert config.host == "0.0.0.0", where
        assert config.port != 0 and config.metrics_port not in (None, 0, config.port), where
        assert config.snapshot_dir is not None, where


# -- the health checks ---------------------------------------------------------------------


def health_snippets() -> list[tuple[str, str]]:
    snippets = [(f"compose {n}", s["healthcheck"]["test"][3]) for n, s in shard_services().items()]
    for word, rest in dockerfile():
        if word == "HEALTHCHECK":
            exec_form = docker_exec_form(rest[rest.index("CMD ") + 4 :])
            assert exec_form[:2] == ["python", "-c"]
            snippets.append(("Dockerfile HEALTHCHECK", exec_form[2]))
    return snippets


def run_snippet(code: str) -> int:
    """The exit status `python -c code` would have."""
    try:
        exec(compile(code, "healthcheck", "exec"), {})
    except SystemExit as exit_:
        return 0 if exit_.code is None else int(exit_.code)
    except Exception:  # an uncaught exception: python exits 1
        return 1
    return 0


def test_health_snippets_report_the_real_health_service(tmp_path: Path) -> None:
    from grpc_health.v1 import health_pb2

    from tierps.server.daemon import create_server

    config = ServerConfig(
        shard_id=0, num_shards=1, data_dir=tmp_path / "data", port=0, health_port=0
    )
    server, _ = create_server(config)
    port = server.health_port
    snippets = health_snippets()
    assert len(snippets) == len(shard_services()) + 1
    local = [
        (where, re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{port}", code)) for where, code in snippets
    ]
    with server:
        for where, code in local:
            assert run_snippet(code) == 0, where
        server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        for where, code in local:
            assert run_snippet(code) == 1, f"{where} passes a NOT_SERVING shard"
    for where, code in local:
        assert run_snippet(code) == 1, f"{where} passes a stopped shard"


# -- security ------------------------------------------------------------------------------


def test_the_secrets_are_mounted_where_the_flags_read_them() -> None:
    container = shard_container(k8s_docs()["StatefulSet"])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {
        v["name"]: v for v in k8s_docs()["StatefulSet"]["spec"]["template"]["spec"]["volumes"]
    }
    for option in ("--tls-cert", "--tls-key", "--tls-client-ca", "--tokens-file"):
        path = Path(flag(container["args"], option))
        mount = mounts[str(path.parent)]
        assert mount["readOnly"] is True, option
        assert "secretName" in volumes[mount["name"]]["secret"], option
    declared = set(compose()["secrets"])
    for name, service in shard_services().items():
        for option in ("--tls-cert", "--tls-key", "--tls-client-ca", "--tokens-file"):
            path = Path(flag(service["command"], option))
            assert path.parent == Path("/run/secrets"), (name, option)
            assert path.name in service["secrets"] and path.name in declared, (name, option)


def test_the_network_policy_admits_clients_to_grpc_and_monitoring_to_metrics() -> None:
    docs = k8s_docs()
    policy, sts = docs["NetworkPolicy"], docs["StatefulSet"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    container = shard_container(sts)
    allowed = {
        int(port["port"]): rule["from"]
        for rule in policy["spec"]["ingress"]
        for port in rule["ports"]
    }
    grpc_port = int(flag(container["args"], "--port"))
    metrics_port = int(flag(container["args"], "--metrics-port"))
    assert set(allowed) == {grpc_port, metrics_port}  # nothing else, health included
    assert allowed[grpc_port] == [{"podSelector": {"matchLabels": {"tierps.io/client": "true"}}}]
    assert "namespaceSelector" in allowed[metrics_port][0]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="make-secrets.sh needs openssl")
def test_make_secrets_makes_what_a_secured_shard_and_its_clients_use(tmp_path: Path) -> None:
    import grpc
    import numpy as np

    from tierps.client import ChannelSecurity, EmbeddingClient, ShardError, TableConfig
    from tierps.server.daemon import create_server

    secrets = tmp_path / "secrets"
    subprocess.run(["bash", str(DEPLOY / "make-secrets.sh"), str(secrets)], check=True,
                   capture_output=True)  # fmt: skip
    config = ServerConfig(
        shard_id=0, num_shards=1, data_dir=tmp_path / "data", tls_cert=secrets / "tls.crt",
        tls_key=secrets / "tls.key", tls_client_ca=secrets / "ca.crt",
        tokens_file=secrets / "tokens",
    )  # fmt: skip
    server, port = create_server(config)
    client_files = {"ca_file": secrets / "ca.crt", "cert_file": secrets / "client.crt",
                    "key_file": secrets / "client.key"}  # fmt: skip

    def client(role: str) -> EmbeddingClient:
        token = (secrets / f"{role}_token").read_text().strip()
        security = ChannelSecurity(**client_files, token=token)
        return EmbeddingClient([f"localhost:{port}"], timeout_s=10, security=security)

    with server:
        with client("admin") as admin:
            admin.create_table(TableConfig(name="t", dim=4))
        with client("trainer") as trainer:
            assert trainer.lookup("t", np.arange(3)).shape == (3, 4)
        with client("reader") as reader, pytest.raises(ShardError) as refused:
            reader.drop_table("t")
        assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
