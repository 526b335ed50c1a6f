"""deploy/: the Dockerfile, compose file and Kubernetes manifests agree with each other and
with the real `tierps serve` command line, and every command deploy/README.md documents is
run here (make-secrets.sh as a non-root user, `tierps admin` with TLS and tokens against real
shards, the token rotation against a running shard) or, for docker and kubectl, checked
against the compose file and manifests it acts on."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
            shard_id=ns.shard_id,
            num_shards=ns.num_shards,
            data_dir=ns.data_dir,
            snapshot_dir=ns.snapshot_dir,
            host=ns.host,
            port=ns.port,
            metrics_port=ns.metrics_port,
        )
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


# -- deploy/README.md's commands -------------------------------------------------------------

README = DEPLOY / "README.md"
SECRETS = DEPLOY / "secrets"  # the one secrets directory of the docs and the compose file
NOBODY = 65534  # a non-root user to run the documented shell steps as, where tests run as root
CONTAINER_UID = 10001  # the image's user (Dockerfile USER)
CLIENT_FLAGS = ("--tls-ca", "--tls-client-cert", "--tls-client-key", "--token-file")
ROTATION_MARK = "trainer_token.new"  # the block of the token rotation steps
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def readme_blocks() -> list[str]:
    """The sh blocks of deploy/README.md, continuation lines joined."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)
    return [re.sub(r"\\\n\s*", " ", block) for block in blocks]


def readme_commands() -> list[tuple[str, list[str]]]:
    """Each command of those blocks as (text, words), comments dropped; each part of a
    pipeline is a command of its own."""
    out = []
    for block in readme_blocks():
        for line in block.splitlines():
            for part in line.split(" | "):
                words = shlex.split(part, comments=True)
                if words:
                    out.append((part.strip(), words))
    return out


def rotation_lines() -> set[str]:
    (block,) = [b for b in readme_blocks() if ROTATION_MARK in b]
    return {line.strip() for line in block.splitlines()}


def admin_pod() -> dict[str, Any]:
    return yaml.safe_load((K8S / "admin" / "pod.yaml").read_text())


def secret_mounts(pod_spec: dict[str, Any]) -> dict[str, str]:
    """{mount path: Secret name} of a pod spec's single container."""
    (container,) = pod_spec["containers"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod_spec["volumes"] if "secret" in v}
    return {
        m["mountPath"]: secrets[m["name"]]
        for m in container["volumeMounts"]
        if m["name"] in secrets
    }


def created_secrets() -> dict[str, dict[str, str]]:
    """{Secret: {key: file}} of the README's `kubectl create secret generic` commands."""
    created: dict[str, dict[str, str]] = {}
    for _, words in readme_commands():
        if words[:4] == ["kubectl", "create", "secret", "generic"]:
            files = dict(
                w.split("=", 1)[1].split("=", 1) for w in words if w.startswith("--from-file=")
            )
            assert created.setdefault(words[4], files) == files, f"{words[4]} made two ways"
    return created


def is_tierps(words: list[str]) -> list[str] | None:
    """The `tierps ...` words of a command that runs tierps (on the host, in a compose
    service or in a pod); None for any other."""
    if words[0] == "tierps":
        return words
    if words[:5] == ["docker", "compose", "-f", "deploy/compose.yaml", "exec"]:
        return words[6:]
    if words[:2] == ["kubectl", "exec"] and "--" in words:
        return words[words.index("--") + 1 :]
    return None


def documented_addresses(words: list[str]) -> tuple[str, list[str]]:
    """(where the command runs: "host", "compose" or "k8s", the documented addresses)."""
    addresses = flag(words, "--addresses").split(",")
    where = "host" if words[0] == "tierps" else "compose" if words[0] == "docker" else "k8s"
    return where, addresses


def expected_addresses(where: str, count: int) -> list[str]:
    """The addresses of shards 0..count-1 as each place reaches them."""
    if where == "compose":
        services = shard_services()
        return [
            f"shard-{i}:{flag(services[f'shard-{i}']['command'], '--port')}" for i in range(count)
        ]
    if where == "host":  # the gRPC port each shard service publishes on loopback
        published = []
        for i in range(count):
            service = shard_services()[f"shard-{i}"]
            grpc_port = int(flag(service["command"], "--port"))
            published += [p["published"] for p in service["ports"] if int(p["target"]) == grpc_port]
        return [f"localhost:{port}" for port in published]
    sts = k8s_docs()["StatefulSet"]
    port = flag(shard_container(sts)["args"], "--port")
    return [
        f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{port}" for i in range(count)
    ]


def secret_file(where: str, words: list[str], path: str) -> Path:
    """The file under the repository root a documented client path reads, through the
    compose secrets or the admin pod's Secret (checked to be mounted where the command runs)."""
    if where == "host":
        return Path(path)
    if where == "compose":
        service = shard_services()[words[5]]
        name = Path(path).name
        assert Path(path).parent == Path("/run/secrets"), path
        assert name in service["secrets"], f"{path}: not a secret of {words[5]}"
        return (DEPLOY / compose()["secrets"][name]["file"]).resolve().relative_to(ROOT)
    pod = admin_pod()
    assert words[2] == pod["metadata"]["name"], f"`tierps admin` runs in {words[2]}"
    secret = secret_mounts(pod["spec"])[str(Path(path).parent)]
    return Path(created_secrets()[secret][Path(path).name])


def check_docker(words: list[str]) -> None:
    if words[1] == "build":
        assert (ROOT / flag(words, "-f")).is_file() and words[-1] == ".", words
    elif words[1] == "run":
        with pytest.raises(SystemExit) as done:
            cli.main(words[words.index("tierps") + 1 :])
        assert done.value.code == 0, words
    else:
        assert words[:4] == ["docker", "compose", "-f", "deploy/compose.yaml"], words
        assert words[4] in {"up", "ps", "exec", "down"}, words
        if words[4] == "exec":
            assert words[5] in shard_services(), words


def check_kubectl(words: list[str]) -> None:
    sts = k8s_docs()["StatefulSet"]
    name, replicas = sts["metadata"]["name"], sts["spec"]["replicas"]
    verb = words[1]
    if verb == "create":
        mounted = secret_mounts(sts["spec"]["template"]["spec"]) | secret_mounts(
            admin_pod()["spec"]
        )
        files = created_secrets()[words[4]]
        assert words[4] in mounted.values(), f"Secret {words[4]} is mounted nowhere"
        assert all(Path(f).parent == SECRETS.relative_to(ROOT) for f in files.values()), files
        # what the shard flags read from each Secret's mount is among its keys
        for option in ("--tls-cert", "--tls-key", "--tls-client-ca", "--tokens-file"):
            path = Path(flag(shard_container(sts)["args"], option))
            if mounted[str(path.parent)] == words[4]:
                assert path.name in files, f"{option} {path}: no key {path.name} in {words[4]}"
    elif verb == "apply":
        target = words[words.index("-k") + 1] if "-k" in words else words[words.index("-f") + 1]
        assert target == "-" or (ROOT / target).exists(), words
    elif verb == "rollout":
        assert words[2:] == ["status", f"statefulset/{name}"], words
    elif verb == "wait":
        assert words[-1] == f"pod/{admin_pod()['metadata']['name']}", words
    elif verb == "delete":
        if words[2] == "statefulset":
            assert words[3:] == [name], words
        else:
            template = sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
            assert words[2] == "pvc" and words[3:] == [
                f"{template}-{name}-{i}" for i in range(replicas)
            ]
    elif verb == "logs":
        assert words[2] == f"{name}-0", words
    else:
        assert verb == "exec" and is_tierps(words), words


def test_every_readme_command_is_run_or_checked_here() -> None:
    """Every command of deploy/README.md is one these tests run (make-secrets.sh, tierps,
    the rotation's shell steps) or, for docker and kubectl, agrees with the files it acts on."""
    rotation = rotation_lines()
    kinds: dict[str, int] = {}
    for text, words in readme_commands():
        tierps = is_tierps(words)
        if tierps is not None:
            kind = "tierps"
            assert tierps[:2] == ["tierps", "admin"], text
            where, addresses = documented_addresses(words)
            assert addresses == expected_addresses(where, len(addresses)), text
            for option in CLIENT_FLAGS:  # the manifests require TLS (mutual) and tokens
                assert (ROOT / secret_file(where, words, flag(tierps, option))).parent == SECRETS
        elif words[-2:] == ["deploy/make-secrets.sh", "deploy/secrets"]:
            kind = "make-secrets"
        elif words[0] == "docker":
            kind = "docker"
            check_docker(words)
        elif words[0] == "kubectl":
            kind = "kubectl"
            check_kubectl(words)
        elif words == ["grep", "tokens file"]:  # after `kubectl logs`: the rotation test
            kind = "grep"
        else:
            kind = "rotation"
            assert any(text in line for line in rotation), f"not run by any test: {text}"
        kinds[kind] = kinds.get(kind, 0) + 1
    assert set(kinds) == {"tierps", "make-secrets", "docker", "kubectl", "grep", "rotation"}


def test_one_secrets_directory_everywhere_and_git_ignores_it() -> None:
    documented = set(re.findall(r"[\w./-]*secrets/[\w.]+", README.read_text()))
    documented |= set(re.findall(r"[\w./-]*secrets/[\w.]+", (ROOT / "README.md").read_text()))
    documented -= {p for p in documented if p.startswith(("/run/secrets/", "/etc/"))}
    assert documented and {str(Path(p).parent) for p in documented} == {"deploy/secrets"}, (
        documented
    )
    for name, secret in compose()["secrets"].items():
        assert (DEPLOY / secret["file"]).resolve().parent == SECRETS, name
    for _, words in readme_commands():
        if "deploy/make-secrets.sh" in words:
            assert words[words.index("deploy/make-secrets.sh") + 1] == "deploy/secrets", words
    if shutil.which("git") and (ROOT / ".git").exists():
        for path in ("deploy/secrets/tokens", "deploy/secrets/ca.key", "deploy/.env"):
            ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path])
            assert ignored.returncode == 0, f"git does not ignore {path}"
    for service in shard_services().values():  # the group make-secrets.sh writes, joined
        assert service["group_add"] == [
            "${TIERPS_SECRETS_GID:?is not set: run deploy/make-secrets.sh deploy/secrets, "
            "which writes it to deploy/.env}"
        ]


# -- running them ----------------------------------------------------------------------------


def as_user(argv: list[str], uid: int = NOBODY, groups: tuple[int, ...] = ()) -> list[str]:
    """argv run as a non-root user: `uid` (with `groups`) where the tests run as root."""
    if os.geteuid() != 0:
        return argv
    joined = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", *joined, *argv]


@pytest.fixture
def checkout() -> Iterator[Path]:
    """A directory standing for the repository root, owned by the user the documented
    steps run as, with deploy/ copied in (no secrets), and its secrets made by the README's
    own make-secrets.sh command."""
    root = Path(tempfile.mkdtemp(prefix="tierps-deploy-", dir="/tmp"))
    try:
        shutil.copytree(DEPLOY, root / "deploy", ignore=shutil.ignore_patterns("secrets", ".env"))
        if os.geteuid() == 0:
            for path in [root, *root.rglob("*")]:
                os.chown(path, NOBODY, NOBODY)
        root.chmod(0o755)
        (command,) = {t for t, w in readme_commands() if "deploy/make-secrets.sh" in w} - {
            t for t, w in readme_commands() if w[0].startswith("NAMESPACE=")
        }
        made = subprocess.run(
            as_user(["bash", "-c", command]),
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HOME": str(root)},
        )
        assert made.returncode == 0, made.stderr
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@needs_openssl
def test_make_secrets_writes_keys_and_tokens_for_their_owner_and_group(checkout: Path) -> None:
    secrets = checkout / "deploy" / "secrets"
    assert mode(secrets) == 0o750
    assert mode(secrets / "ca.key") == 0o600
    shared = ["tls.key", "client.key", "tokens", "admin_token", "trainer_token", "reader_token"]
    for name in shared:
        assert mode(secrets / name) == 0o640, name
    for name in ("ca.crt", "tls.crt", "client.crt"):
        assert mode(secrets / name) == 0o644, name
    gid = (secrets / "tokens").stat().st_gid
    assert (checkout / "deploy" / ".env").read_text() == f"TIERPS_SECRETS_GID={gid}\n"
    # the image's user reads what compose mounts once it joins that group (group_add), and
    # nothing without it
    mounted = [secrets / Path(s["file"]).name for s in compose()["secrets"].values()]
    if os.geteuid() == 0:
        for groups in ((gid,), ()):
            read = subprocess.run(
                as_user(["cat", *map(str, mounted)], CONTAINER_UID, groups),
                capture_output=True,
                timeout=10,
            )
            assert (read.returncode == 0) == bool(groups), (groups, read.stderr)
    # a second run keeps every file, and takes back modes an older run left; a .env there
    # keeps its own lines and mode (it may hold other secrets)
    tokens = (secrets / "tokens").read_text()
    (secrets / "tokens").chmod(0o444)
    env_file = checkout / "deploy" / ".env"
    env_file.write_text("REGISTRY_PASSWORD=hunter2\n" + env_file.read_text())
    env_file.chmod(0o600)
    again = subprocess.run(
        as_user(["bash", "deploy/make-secrets.sh", "deploy/secrets"]),
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr
    assert (secrets / "tokens").read_text() == tokens and mode(secrets / "tokens") == 0o640
    assert mode(env_file) == 0o600
    assert env_file.read_text() == f"REGISTRY_PASSWORD=hunter2\nTIERPS_SECRETS_GID={gid}\n"
    # a directory git would commit is refused, and left as it was
    if shutil.which("git"):
        subprocess.run(
            as_user(["git", "init", "-q", "."]),
            cwd=checkout,
            check=True,
            env={**os.environ, "HOME": str(checkout)},
        )
        shutil.copy(ROOT / ".gitignore", checkout / ".gitignore")
        refused = subprocess.run(
            as_user(["bash", "deploy/make-secrets.sh", "./secrets"]),
            cwd=checkout,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HOME": str(checkout)},
        )
        assert refused.returncode == 2, refused.stderr
        assert "expected a directory git ignores" in refused.stderr
        assert "and not ignored" in refused.stderr and not (checkout / "secrets").exists()


def secured_config(root: Path, data_dir: Path, **fields: Any) -> ServerConfig:
    secrets = root / "deploy" / "secrets"
    return ServerConfig(
        data_dir=data_dir,
        tls_cert=secrets / "tls.crt",
        tls_key=secrets / "tls.key",
        tls_client_ca=secrets / "ca.crt",
        tokens_file=secrets / "tokens",
        grace_s=1.0,
        **fields,
    )


def client_security(root: Path, token_file: str) -> Any:
    from tierps.client import ChannelSecurity

    secrets = root / "deploy" / "secrets"
    return ChannelSecurity(
        ca_file=secrets / "ca.crt",
        cert_file=secrets / "client.crt",
        key_file=secrets / "client.key",
        token=(secrets / token_file).read_text().strip(),
    )


@pytest.mark.slow  # a subprocess
@needs_openssl
def test_readme_tierps_commands_run_with_tls_and_tokens_against_real_shards(
    checkout: Path,
) -> None:
    """Each documented `tierps admin` (from the host, in a compose service, in the admin
    pod) runs as written but for its addresses (local shards, in the same order) and its
    mounted paths (the files they are mounted from): the reshard's save on two shards and
    its load on four keep every row."""
    import numpy as np

    from tierps.client import EmbeddingClient, TableConfig
    from tierps.server.daemon import create_server

    clusters: dict[int, list[Any]] = {}

    def addresses(count: int) -> list[str]:
        if count not in clusters:
            clusters[count] = []
            for shard_id in range(count):
                config = secured_config(
                    checkout,
                    checkout / f"data-{count}-{shard_id}",
                    shard_id=shard_id,
                    num_shards=count,
                    snapshot_dir=checkout / "snapshots",
                )
                server, _ = create_server(config)
                server.start()
                clusters[count].append(server)
        return [f"localhost:{server.port}" for server in clusters[count]]

    keys = np.arange(200)
    values = np.repeat(keys[:, None], 4, axis=1).astype(np.float32)
    admin = client_security(checkout, "admin_token")
    try:
        with EmbeddingClient(addresses(2), timeout_s=10, security=admin) as client:
            client.create_table(TableConfig(name="t", dim=4))
            client.assign("t", keys, values)
        ran = []
        for text, words in readme_commands():
            tierps = is_tierps(words)
            if tierps is None:
                continue
            where, documented = documented_addresses(words)
            local = list(tierps)
            local[local.index("--addresses") + 1] = ",".join(addresses(len(documented)))
            for option in CLIENT_FLAGS:
                index = local.index(option) + 1
                local[index] = str(secret_file(where, words, local[index]))
            done = subprocess.run(
                [sys.executable, "-m", "tierps.server.cli", *local[1:]],
                cwd=checkout,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, f"{text}\n{done.stdout}\n{done.stderr}"
            ran.append(local[-1])
        assert ran.count("stats") >= 3 and "reshard-1" in ran, ran
        with EmbeddingClient(addresses(4), timeout_s=10, security=admin) as client:
            np.testing.assert_array_equal(client.lookup("t", keys, create=False), values)
    finally:
        for servers in clusters.values():
            for server in servers:
                server.stop()


@pytest.mark.slow  # a subprocess
@needs_openssl
def test_readme_token_rotation_runs_as_a_non_root_user_against_a_running_shard(
    checkout: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The rotation steps, as written but for the kubectl lines (checked against the
    manifests elsewhere), run by the secrets' owner against a shard reading the tokens
    file: the new token works after step 1, the old one is refused after step 3, and every
    file keeps its inode and mode."""
    import logging

    import grpc

    from tierps.client import ChannelSecurity
    from tierps.proto import tierps_service_pb2 as pb
    from tierps.proto import tierps_service_pb2_grpc as pb_grpc
    from tierps.server import security
    from tierps.server.daemon import create_server

    secrets = checkout / "deploy" / "secrets"
    config = secured_config(checkout, checkout / "data", shard_id=0, num_shards=1)
    server, port = create_server(config)
    server.start()
    channel = ChannelSecurity(
        ca_file=secrets / "ca.crt",
        cert_file=secrets / "client.crt",
        key_file=secrets / "client.key",
    ).channel(f"localhost:{port}")
    stub = pb_grpc.AdminServiceStub(channel)

    def code(token: str) -> grpc.StatusCode:
        try:
            stub.Stats(
                pb.StatsRequest(), timeout=5, metadata=[("authorization", f"Bearer {token}")]
            )
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    def settles(token: str, expected: grpc.StatusCode) -> None:
        deadline = time.monotonic() + 10 * security.RELOAD_CHECK_S
        while code(token) is not expected:
            assert time.monotonic() < deadline, f"the tokens file change was not taken: {expected}"
            time.sleep(0.1)

    (block,) = [b for b in readme_blocks() if ROTATION_MARK in b]
    steps: dict[int, list[str]] = {}
    step = 0
    for line in block.splitlines():
        marked = re.match(r"# (\d)\. ", line)
        step = int(marked.group(1)) if marked else step
        if shlex.split(line, comments=True) and not line.startswith("kubectl"):
            steps.setdefault(step, []).append(line)
    assert sorted(steps) == [1, 3], steps

    def run(step: int) -> None:
        script = "set -euo pipefail\n" + "\n".join(steps[step])
        done = subprocess.run(
            as_user(["bash", "-c", script]),
            cwd=checkout,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, f"step {step}: {done.stderr}"

    old = (secrets / "trainer_token").read_text().strip()
    inodes = {name: (secrets / name).stat().st_ino for name in ("tokens", "trainer_token")}
    try:
        with caplog.at_level(logging.WARNING, logger="tierps.server"):
            assert code(old) is grpc.StatusCode.OK
            run(1)
            new = (secrets / ROTATION_MARK).read_text().strip()
            assert new != old and mode(secrets / ROTATION_MARK) == 0o600
            settles(new, grpc.StatusCode.OK)
            assert code(old) is grpc.StatusCode.OK
            assert "tokens file" in caplog.text and "changed: 4 tokens now" in caplog.text
            run(3)
            settles(old, grpc.StatusCode.UNAUTHENTICATED)
            assert code(new) is grpc.StatusCode.OK
    finally:
        channel.close()
        server.stop()
    assert (secrets / "trainer_token").read_text().strip() == new
    assert not (secrets / ROTATION_MARK).exists()
    for name, inode in inodes.items():  # in place: what compose's bind mount sees
        assert (secrets / name).stat().st_ino == inode and mode(secrets / name) == 0o640, name
    assert len((secrets / "tokens").read_text().split()) == 3
    assert old not in caplog.text and new not in caplog.text
