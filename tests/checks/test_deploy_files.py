"""The deployment files (Dockerfile, docker-compose.yml, deploy/) agree with the flags they pass.

Every Conveyor command in them is parsed with the parser every Conveyor process uses (conveyor/config.py), and
the ports, probes, health checks, scrape targets and grace periods around it are checked against what it parsed.
No network and no Docker daemon: docker-compose.yml is read as `docker compose config` reads it, by a Compose v2
binary where one is installed and by tests/checks/compose_config.py (the Compose Specification through the
`compose-spec` package, then Compose's normalization) where none is.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import compose_config
import pytest
import yaml

from conveyor import config
from conveyor.config import SECRET, Config
from conveyor.launcher import image
from conveyor.router.transport.connect import group_addresses
from conveyor.shard_channels import parse_tcp

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
COLLECTOR = ROOT / "deploy" / "otel-collector.yaml"
KUBERNETES = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(KUBERNETES.glob("*.yaml"))

CONSOLE_SCRIPTS = ("conveyor-launcher", "conveyor-router", "conveyor-shard")
# What a stop takes beyond --graceful-termination-timeout: the router's flush of ended streams (FLUSH_SECONDS in
# router/main.py), then up to 10 s for each shard to stop (launcher/processes.py).
FLUSH_SECONDS = 5.0
STOP_MARGIN = FLUSH_SECONDS + 10.0
# Compose waits 10 s by default before SIGKILL, Kubernetes 30 s.
COMPOSE_DEFAULT_GRACE = 10.0
KUBERNETES_DEFAULT_GRACE = 30.0
# Environment variables LeaderWorkerSet sets in every container of a group, with a value for each that parses.
LWS_VARIABLES = {"LWS_LEADER_ADDRESS": "conveyor-multinode-0.conveyor-multinode", "LWS_WORKER_INDEX": "1"}
WILDCARDS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class Process:
    """One Conveyor command found in a deployment file, and what it parsed to."""

    where: str
    script: str
    argv: tuple[str, ...]
    flags: Config

    @property
    def serves_http(self) -> bool:
        """Runs a router: conveyor-router, or a launcher on node 0."""
        return self.script == "conveyor-router" or (self.script == "conveyor-launcher" and self.flags.node_rank == 0)

    @property
    def front_doors(self) -> set[int]:
        if not self.serves_http:
            return set()
        return {self.flags.port} | ({self.flags.grpc_port} if self.flags.grpc_port else set())

    @property
    def shard_ports(self) -> list[int]:
        """TCP ports its shards listen on: local rank i on the --listen port + i."""
        if self.flags.listen is None or self.script == "conveyor-router":
            return []
        first = urlsplit(self.flags.listen).port
        return [first + i for i in range(1 if self.script == "conveyor-shard" else self.flags.num_shard)]

    @property
    def master_ports(self) -> set[int]:
        """torch.distributed's rendezvous, served by node 0 for the other nodes."""
        several = self.script == "conveyor-launcher" and self.flags.nnodes > 1 and self.flags.node_rank == 0
        return {self.flags.master_port} if several else set()

    @property
    def ports(self) -> set[int]:
        return self.front_doors | set(self.shard_ports) | self.master_ports


def parse_process(where: str, command: list[str]) -> Process:
    """argparse exits on a flag it does not know or a bad value: that is a failure naming the file and the args."""
    script, argv = command[0], [str(a) for a in command[1:]]
    assert script in CONSOLE_SCRIPTS, f"{where}: {script} is not a Conveyor console script"
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            namespace = config.parser(script).parse_args(argv)
    except SystemExit:
        namespace = None
    if namespace is None:  # the last line of argparse's message is the reason
        reason = errors.getvalue().strip().splitlines()[-1]
        pytest.fail(f"{where}: conveyor's parser refuses `{shlex.join(command)}`: {reason}")
    for name in SECRET:
        flag = "--" + name.replace("_", "-")
        assert flag not in argv, f"{where}: {flag} on a command line (`ps` shows it): use ${SECRET[name]}"
    return Process(where, script, tuple(argv), Config(**vars(namespace)))


def check_reachable(process: Process) -> None:
    """A router in a container or pod must listen beyond its loopback; several nodes must find each other."""
    if process.serves_http:
        assert process.flags.hostname in WILDCARDS, f"{process.where}: --hostname {process.flags.hostname}"
    if process.flags.nnodes > 1:
        assert process.flags.listen, f"{process.where}: several nodes need --listen tcp://HOST:PORT"
        assert process.flags.advertise_host not in (None, *WILDCARDS), f"{process.where}: needs --advertise-host"
        assert process.flags.master_addr != "127.0.0.1", f"{process.where}: --master-addr must be node 0's"


def duration(text: str | None, default: float) -> float:
    """Seconds of a Go duration as `docker-compose config` writes them (`1m30s`, `5m0s`)."""
    if text is None:
        return default
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|h|m|s)", text)
    assert parts and "".join(a + b for a, b in parts) == text, f"not a duration: {text!r}"
    return sum(float(amount) * units[unit] for amount, unit in parts)


# --- Dockerfile ------------------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined, comments left out."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def test_the_image_serves_what_its_command_says() -> None:
    instructions = dockerfile_instructions()
    runtime = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM") :]  # the last stage
    by_kind: dict[str, list[str]] = {}
    for keyword, rest in runtime:
        by_kind.setdefault(keyword, []).append(rest)
    # The entrypoint runs a command as it is, and flags alone as TGI's image did (tests/unit/test_image_entry.py).
    assert by_kind["ENTRYPOINT"] == ['["python", "-m", "conveyor.launcher.image"]']
    (cmd,) = by_kind["CMD"]
    process = parse_process("Dockerfile CMD", json.loads(cmd))  # exec form, so that SIGTERM reaches the launcher
    assert process.script == "conveyor-launcher" and process.flags.model_id == "demo"
    check_reachable(process)
    exposed = {int(p.split("/")[0]) for rest in by_kind["EXPOSE"] for p in rest.split()}
    tgi = {int(image.TGI_PORT)}  # where flags alone serve
    assert exposed == process.front_doors | tgi, f"EXPOSE {exposed} but the command serves {process.front_doors}"
    (healthcheck,) = by_kind["HEALTHCHECK"]
    assert f"127.0.0.1:{process.flags.port}/health" in healthcheck
    assert any(re.search(r"\bCONVEYOR_CACHE=/models\b", env) for env in by_kind["ENV"])
    assert "/models" in " ".join(by_kind["VOLUME"]) and image.TGI_CACHE in " ".join(by_kind["VOLUME"])
    assert "USER" in by_kind and by_kind["USER"][-1] not in ("root", "0"), "the image runs as a user, not root"


def test_the_image_builds_the_kernels_with_the_package_and_runs_without_a_compiler() -> None:
    """The builder stage compiles every CPU kind's library against the torch it installed; the stage that runs
    has no compiler (and so could not build at start, nor needs to)."""
    instructions = dockerfile_instructions()
    last = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    builder, runtime = instructions[:last], instructions[last:]
    runs = lambda stage: " ".join(rest for keyword, rest in stage if keyword == "RUN")  # noqa: E731
    assert re.search(r"apt-get install [^&]*\bg\+\+", runs(builder))
    assert re.search(r"pip install --no-build-isolation \.", runs(builder))
    assert not re.search(r"\b(g\+\+|gcc|clang|build-essential|ninja)\b", runs(runtime)), runs(runtime)
    assert any(keyword == "COPY" and "--from=builder /opt/venv" in rest for keyword, rest in runtime)


# --- docker-compose.yml ----------------------------------------------------------------------------------------


def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


PROFILES = sorted({p for service in raw_compose()["services"].values() for p in service.get("profiles", [])})


def compose_env() -> dict[str, str]:
    """This environment less what would change the reading: COMPOSE_* settings, the tokens, NUM_SHARD."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    for name in ("CONVEYOR_API_KEY", "CONVEYOR_SHARD_TOKEN", "NUM_SHARD"):
        env.pop(name, None)
    return env


COMPOSE_BINARY = compose_config.binary()


def compose_read(profiles: list[str]) -> dict:
    try:
        return compose_config.config(COMPOSE_FILE, profiles, compose_env(), COMPOSE_BINARY)
    except compose_config.ComposeError as exc:
        pytest.fail(f"Compose refuses {COMPOSE_FILE.name} (profiles {profiles}):\n{exc}")


@pytest.mark.parametrize("profile", [None, *PROFILES])
def test_compose_accepts_the_file(profile: str | None) -> None:
    services = set(compose_read([] if profile is None else [profile])["services"])
    expected = {
        name for name, s in raw_compose()["services"].items() if not s.get("profiles") or profile in s["profiles"]
    }
    assert services == expected


@pytest.mark.skipif(COMPOSE_BINARY is None, reason="no Compose v2 binary here to compare the reader with")
def test_the_reader_reads_as_compose_does() -> None:
    """Where a Compose binary is installed, tests/checks/compose_config.py's reading agrees with it on every key
    these checks read."""
    real = compose_config.config(COMPOSE_FILE, PROFILES, compose_env(), COMPOSE_BINARY)
    ours = compose_config.read(COMPOSE_FILE, PROFILES, compose_env())
    assert set(ours["services"]) == set(real["services"])
    for name, service in real["services"].items():
        for key in ("command", "environment", "image", "healthcheck"):
            assert ours["services"][name].get(key) == service.get(key), f"{name}.{key}"
        for key, fields in (("ports", ("target", "published", "host_ip")), ("volumes", ("source", "target"))):
            pick = [{f: v.get(f) for f in fields} for v in ours["services"][name].get(key, [])]
            assert pick == [{f: v.get(f) for f in fields} for v in service.get(key, [])], f"{name}.{key}"


@pytest.fixture(scope="module")
def compose() -> dict:
    """The file as Compose reads it, every profile on: anchors merged, variables filled in, ports normalized."""
    return compose_read(PROFILES)


def compose_processes(compose: dict) -> dict[str, Process]:
    processes = {
        name: parse_process(f"docker-compose.yml service {name}", service["command"])
        for name, service in compose["services"].items()
        if service.get("command") and service["command"][0] in CONSOLE_SCRIPTS
    }
    built = {name for name, service in compose["services"].items() if "build" in service}
    assert built <= set(processes), (
        f"services of the Conveyor image without a Conveyor command: {built - set(processes)}"
    )
    return processes


def test_compose_commands_parse(compose: dict) -> None:
    processes = compose_processes(compose)
    assert {p.script for p in processes.values()} == set(CONSOLE_SCRIPTS)
    for process in processes.values():
        check_reachable(process)


def test_compose_ports_health_checks_and_grace_periods(compose: dict) -> None:
    for name, process in compose_processes(compose).items():
        service, where = compose["services"][name], process.where
        published = {p["target"] for p in service.get("ports", []) if p.get("published")}
        assert published <= process.front_doors, (
            f"{where}: publishes {sorted(published - process.front_doors)}; only the front doors "
            f"{sorted(process.front_doors)} may face the host (shard and master ports never)"
        )
        if process.serves_http:
            assert process.flags.port in published, f"{where}: the HTTP port {process.flags.port} is not published"
        check = " ".join(service["healthcheck"]["test"])
        if process.serves_http:
            assert f"127.0.0.1:{process.flags.port}/health" in check, f"{where}: health check {check!r}"
        else:
            probe = f"conveyor.shard.probe tcp://127.0.0.1:{process.shard_ports[0]} --kill-if-stuck"
            assert process.shard_ports and probe in check, (
                f"{where}: a shard's health check is the probe on its port, which restarts a stuck shard: {check!r}"
            )
        grace = duration(service.get("stop_grace_period"), COMPOSE_DEFAULT_GRACE)
        needed = process.flags.graceful_termination_timeout + STOP_MARGIN if process.serves_http else FLUSH_SECONDS
        assert grace >= needed, f"{where}: stop_grace_period {grace:g}s, the drain needs {needed:g}s"


def test_compose_router_reaches_its_shard(compose: dict) -> None:
    processes = compose_processes(compose)
    raw = raw_compose()["services"]
    routers = [p for p in processes.values() if p.script == "conveyor-router"]
    assert routers
    for name, router in processes.items():
        if router.script != "conveyor-router":
            continue
        address = urlsplit(router.flags.shard_address)
        shard = processes.get(address.hostname)
        assert shard is not None and shard.script == "conveyor-shard", f"{router.where}: no shard at {address}"
        assert address.port == shard.shard_ports[0], (
            f"{router.where}: {address.port}, the shard listens on {shard.shard_ports}"
        )
        assert shard.flags.advertise_host == address.hostname, f"{shard.where}: --advertise-host"
        for service in (name, address.hostname):  # the token comes from the environment, with no default
            assert raw[service]["environment"]["CONVEYOR_SHARD_TOKEN"] == "${CONVEYOR_SHARD_TOKEN:-}", service
        if shard.flags.model_id == "demo":  # the router reads the tokenizer the shard built, in the same volume
            cache = compose["services"][address.hostname]["environment"].get("CONVEYOR_CACHE", "/models")
            built = f"{cache}/demo-{shard.flags.demo_size}"
            assert router.flags.model_id == built, f"{router.where}: --model-id, the shard builds the demo in {built}"
            volumes = [
                {(v["source"], v["target"]) for v in compose["services"][s]["volumes"]}
                for s in (name, address.hostname)
            ]
            assert volumes[0] & volumes[1], f"{router.where}: shares no volume with its shard"


def test_compose_demo_builds_do_not_race(compose: dict) -> None:
    """Two services building the demo into one directory of one volume would write the same files at once."""
    seen: dict[tuple[str, str], str] = {}
    for name, process in compose_processes(compose).items():
        if process.script == "conveyor-router" or process.flags.model_id != "demo":
            continue
        service = compose["services"][name]
        cache = service.get("environment", {}).get("CONVEYOR_CACHE", "/models")
        volume = next((v["source"] for v in service.get("volumes", []) if cache.startswith(v["target"])), None)
        assert volume is not None, f"{process.where}: builds the demo into {cache}, which is on no volume"
        key = (volume, f"{cache}/demo-{process.flags.demo_size}")
        assert key not in seen, f"{name} and {seen.get(key)} both build the demo into {key}"
        seen[key] = name


def test_prometheus_scrapes_every_router(compose: dict) -> None:
    scrape = yaml.safe_load(PROMETHEUS.read_text())
    targets = {t for job in scrape["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    expected = {f"{name}:{p.flags.port}" for name, p in compose_processes(compose).items() if p.serves_http}
    assert targets == expected, f"{PROMETHEUS.name} scrapes {sorted(targets)}; the routers are {sorted(expected)}"
    mounts = {(v["source"], v["target"]) for v in compose["services"]["prometheus"]["volumes"]}
    assert (str(PROMETHEUS), "/etc/prometheus/prometheus.yml") in mounts


def test_traces_reach_the_collector(compose: dict) -> None:
    collector = yaml.safe_load(COLLECTOR.read_text())
    receiver = urlsplit("//" + collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    assert "otlp" in collector["service"]["pipelines"]["traces"]["receivers"]
    processes = compose_processes(compose)
    assert all(p.flags.otlp_endpoint for p in processes.values()), "every Conveyor service exports its spans"
    for process in processes.values():
        endpoint = urlsplit(process.flags.otlp_endpoint)
        service = compose["services"][endpoint.hostname]
        assert service["image"].startswith("otel/opentelemetry-collector"), process.where
        assert endpoint.port == receiver.port, f"{process.where}: {endpoint.port}, the collector {receiver.port}"
        assert (str(COLLECTOR), service["command"][0].split("=", 1)[1]) in {
            (v["source"], v["target"]) for v in service["volumes"]
        }


# --- Kubernetes ------------------------------------------------------------------------------------------------


@dataclass
class Pod:
    where: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict
    group: str | None = None  # the LeaderWorkerSet it belongs to
    role: str | None = None  # leaderTemplate or workerTemplate
    kind: str = "Deployment"  # its controller's kind: Deployment, StatefulSet or LeaderWorkerSet
    name: str = ""  # its controller's name

    @property
    def pod_name(self) -> str:
        """A name the pod gets (`metadata.name`): a StatefulSet's first pod, say."""
        return f"{self.name}-0"


def manifests() -> Iterator[tuple[Path, dict]]:
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def pods() -> list[Pod]:
    found = []
    for path, doc in manifests():
        name = doc["metadata"]["name"]
        if doc["kind"] in ("Deployment", "StatefulSet"):
            meta, spec = doc["spec"]["template"]["metadata"], doc["spec"]["template"]["spec"]
            where = f"{path.name} {doc['kind']} {name}"
            found.append(Pod(where, meta["labels"], meta.get("annotations", {}), spec, kind=doc["kind"], name=name))
        elif doc["kind"] == "LeaderWorkerSet":
            for role in ("leaderTemplate", "workerTemplate"):
                template = doc["spec"]["leaderWorkerTemplate"][role]
                meta = template.get("metadata", {})
                # LWS labels every pod of the set with its name.
                labels = {**meta.get("labels", {}), "leaderworkerset.sigs.k8s.io/name": name}
                where = f"{path.name} {name} {role}"
                annotations = meta.get("annotations", {})
                found.append(Pod(where, labels, annotations, template["spec"], name, role, "LeaderWorkerSet", name))
    return found


def substitute(where: str, value: str, env: dict[str, dict], lws: bool, pod_name: str = "conveyor-0") -> str:
    """Kubernetes' own `$(VAR)` expansion in command and args, with a plausible value for each variable. An
    undefined variable would stay `$(VAR)` in the real pod: that is a failure here."""

    def one(match: re.Match) -> str:
        name = match.group(1)
        if lws and name in LWS_VARIABLES:
            return LWS_VARIABLES[name]
        assert name in env, f"{where}: $({name}) is not defined in the container's env"
        source = env[name]
        assert "secretKeyRef" not in source.get("valueFrom", {}), f"{where}: the secret {name} on a command line"
        if "value" in source:
            return source["value"]
        field = source["valueFrom"]["fieldRef"]["fieldPath"]
        assert field in ("status.podIP", "metadata.name"), f"{where}: $({name})"
        return "10.0.0.7" if field == "status.podIP" else pod_name

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, value)


def container_processes(pod: Pod) -> Iterator[tuple[dict, Process]]:
    for container in pod.spec["containers"]:
        command = [*container.get("command", []), *container.get("args", [])]
        if not command or command[0] not in CONSOLE_SCRIPTS:
            continue
        where = f"{pod.where} container {container['name']}"
        env = {e["name"]: e for e in container.get("env", [])}
        argv = [substitute(where, str(a), env, lws=pod.group is not None, pod_name=pod.pod_name) for a in command]
        yield container, parse_process(where, argv)


def all_processes() -> list[tuple[Pod, dict, Process]]:
    found = [(pod, container, process) for pod in pods() for container, process in container_processes(pod)]
    assert found, "no Conveyor container in deploy/kubernetes"
    return found


def probe_port(container: dict, probe: dict) -> int:
    """The port of an httpGet, tcpSocket or grpc probe, a containerPort name resolved, or of the shard an exec
    probe (conveyor.shard.probe) checks."""
    if "exec" in probe:
        command = probe["exec"]["command"]
        assert command[:3] == ["python", "-m", "conveyor.shard.probe"], f"exec probe {command}"
        host, port = parse_tcp(command[3])
        assert host == "127.0.0.1", f"exec probe {command}: the shard in this container"
        return port
    action = next(probe[k] for k in ("httpGet", "tcpSocket", "grpc") if k in probe)
    port = action["port"]
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in named, f"probe port {port!r} names no containerPort"
    return named[port]


def pre_stop_seconds(container: dict) -> float:
    pre_stop = container.get("lifecycle", {}).get("preStop")
    if pre_stop is None:
        return 0.0
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep", f"preStop {command}"
    return float(command[1])


def test_kubernetes_manifests_parse() -> None:
    kinds = {path.name: [doc["kind"] for p, doc in manifests() if p == path] for path in MANIFESTS}
    assert {"Deployment", "Service"} <= set(kinds["deployment.yaml"])
    assert {"LeaderWorkerSet", "Service"} <= set(kinds["leaderworkerset.yaml"])
    assert {"StatefulSet", "Deployment", "Service", "NetworkPolicy"} <= set(kinds["shard-groups.yaml"])
    lws = next(doc for _, doc in manifests() if doc["kind"] == "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"


def test_kubernetes_commands_parse() -> None:
    for _, _, process in all_processes():
        check_reachable(process)


def test_kubernetes_ports_and_probes_follow_the_flags() -> None:
    for pod, container, process in all_processes():
        where = process.where
        declared = {p["containerPort"] for p in container.get("ports", [])}
        assert declared == process.ports, f"{where}: containerPorts {sorted(declared)}, flags {sorted(process.ports)}"
        names = {"http": {process.flags.port}, "grpc": {process.flags.grpc_port}, "shard": set(process.shard_ports)}
        for port in container.get("ports", []):
            if port.get("name") in names:
                assert port["containerPort"] in names[port["name"]], f"{where}: port {port}"
        probes = {kind: container.get(kind) for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
        for kind, probe in probes.items():
            if probe is None:
                continue
            port = probe_port(container, probe)
            assert port in process.ports, f"{where}: {kind} on {port}, not a port the flags open"
            if "httpGet" in probe:
                assert port == process.flags.port, f"{where}: {kind} on {port}, HTTP is {process.flags.port}"
                # /health is 503 while shards restart and while draining: ready, yes; alive, no.
                path = probe["httpGet"]["path"]
                assert (path != "/health") if kind == "livenessProbe" else (path == "/health"), f"{where}: {kind}"
            if "grpc" in probe or "exec" in probe:
                assert port in process.shard_ports, f"{where}: {kind} gRPC probe on {port}, not a shard port"
            if "exec" in probe and kind == "livenessProbe":  # a shard loading or restarting is not dead
                assert "--stuck-only" in probe["exec"]["command"], f"{where}: {kind} must fail on a stuck shard only"
        readiness = probes["readinessProbe"]
        assert readiness is not None, f"{where}: no readinessProbe"
        if process.serves_http:
            assert "httpGet" in readiness, f"{where}: a router's readiness is its /health"
            assert pod.annotations.get("prometheus.io/port") == str(process.flags.port), f"{where}: scrape port"


def test_kubernetes_grace_periods_cover_the_drain() -> None:
    drains: dict[str, float] = {}  # a LeaderWorkerSet's leader: seconds from deletion to the end of its drain
    for pod, container, process in all_processes():
        grace = float(pod.spec.get("terminationGracePeriodSeconds", KUBERNETES_DEFAULT_GRACE))
        pre_stop = pre_stop_seconds(container)
        if process.serves_http:
            assert pre_stop > 0, f"{process.where}: no preStop: the Service may still send after SIGTERM"
            needed = pre_stop + process.flags.graceful_termination_timeout + STOP_MARGIN
            if pod.group is not None:
                drains[pod.group] = pre_stop + process.flags.graceful_termination_timeout + FLUSH_SECONDS
        else:
            needed = pre_stop + STOP_MARGIN
        assert grace >= needed, f"{process.where}: terminationGracePeriodSeconds {grace:g}, needs {needed:g}"
    for pod, container, process in all_processes():
        if not process.serves_http and pod.group in drains:  # a worker's shards serve the leader's drain
            assert pre_stop_seconds(container) >= drains[pod.group], f"{process.where}: stops before the drain ends"


def test_leader_and_workers_are_one_deployment() -> None:
    (lws,) = [doc for _, doc in manifests() if doc["kind"] == "LeaderWorkerSet"]
    name, template = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    by_role = {pod.role: process for pod, _, process in all_processes() if pod.group == name}
    leader, worker = by_role["leaderTemplate"], by_role["workerTemplate"]
    assert leader.flags.nnodes == worker.flags.nnodes == template["size"], "--nnodes is the group's size"
    assert leader.flags.node_rank == 0 and worker.flags.node_rank > 0, "the leader is node 0"
    (container,) = template["workerTemplate"]["spec"]["containers"]
    raw_args = [*container.get("command", []), *container.get("args", [])][1:]
    rank = leader.argv.index("--node-rank") + 1
    assert raw_args[rank] == "$(LWS_WORKER_INDEX)", "each worker's rank is its index in the group"
    assert leader.argv[:rank] + leader.argv[rank + 1 :] == worker.argv[:rank] + worker.argv[rank + 1 :], (
        "every node runs the same flags but --node-rank"
    )
    for process in (leader, worker):
        assert process.flags.master_addr == LWS_VARIABLES["LWS_LEADER_ADDRESS"], process.where


def test_secrets_come_from_secrets() -> None:
    """Tokens and keys come from a Secret (never a literal), the shard token wherever shards are on TCP, and the
    example Secret holds every key the manifests read."""
    secret_keys: dict[str, set[str]] = {}
    for _, doc in manifests():
        if doc["kind"] == "Secret":
            secret_keys[doc["metadata"]["name"]] = set(doc.get("stringData", {})) | set(doc.get("data", {}))
    for _, container, process in all_processes():
        env = {e["name"]: e for e in container.get("env", [])}
        for variable in SECRET.values():
            if variable in env:
                ref = env[variable].get("valueFrom", {}).get("secretKeyRef")
                assert ref is not None, f"{process.where}: {variable} is a literal"
                assert ref["key"] in secret_keys.get(ref["name"], set()), f"{process.where}: {ref} not in secret.yaml"
        if process.flags.listen:
            assert "CONVEYOR_SHARD_TOKEN" in env, f"{process.where}: shards on TCP need the shared token"
        if process.script == "conveyor-router" and any(a.startswith("tcp://") for a in group_addresses(process.flags)):
            assert "CONVEYOR_SHARD_TOKEN" in env, f"{process.where}: a router of shards on TCP needs their token"


def test_services_send_only_to_front_doors() -> None:
    """Every Service selects Conveyor pods and targets their HTTP or gRPC front door, never a shard or master
    port, but for a StatefulSet's headless Service, which balances nothing and only names each pod; NetworkPolicies
    open nothing else to every pod."""
    processes = all_processes()
    governing = {
        doc["spec"]["serviceName"]: doc["metadata"]["name"] for _, doc in manifests() if doc["kind"] == "StatefulSet"
    }
    for _, doc in manifests():
        if doc["kind"] not in ("Service", "NetworkPolicy"):
            continue
        where = f"{doc['kind']} {doc['metadata']['name']}"
        selector = doc["spec"]["selector"] if doc["kind"] == "Service" else doc["spec"]["podSelector"]["matchLabels"]
        selected = [(c, p) for pod, c, p in processes if selector.items() <= pod.labels.items()]
        assert selected, f"{where} selects no Conveyor pod"
        if doc["kind"] == "Service" and doc["metadata"]["name"] in governing:
            assert doc["spec"].get("clusterIP") == "None", f"{where}: a StatefulSet's Service is headless"
            owners = {pod.name for pod, _, _ in processes if selector.items() <= pod.labels.items()}
            assert owners == {governing[doc["metadata"]["name"]]}, f"{where} selects pods of {sorted(owners)}"
            for port in doc["spec"]["ports"]:
                for container, process in selected:
                    target = _target_port(port, container)
                    assert target in process.shard_ports, f"{where}: targetPort {port['targetPort']} -> {target}"
        elif doc["kind"] == "Service":
            serving = [(c, p) for c, p in selected if p.serves_http]
            assert serving == selected, f"{where} selects pods that run no router"
            for port in doc["spec"]["ports"]:
                for container, process in selected:
                    target = _target_port(port, container)
                    assert target in process.front_doors, f"{where}: targetPort {port['targetPort']} -> {target}"
        else:
            front_doors = set.union(*(p.front_doors for _, p in selected))
            for rule in doc["spec"].get("ingress", []):
                if "from" in rule:
                    continue
                assert "ports" in rule, f"{where}: a rule opens every port to everyone"
                opened = {p["port"] for p in rule["ports"]}
                assert opened <= front_doors, f"{where}: opens {sorted(opened - front_doors)} to everyone"


def test_one_router_drives_every_shard_group() -> None:
    """shard-groups.yaml: each pod of the StatefulSet is one shard group, named by its stable DNS name; the one
    router names every pod, in ordinal order (group i is pod i: /info, /metrics and the drain route say i), by the
    name each pod advertises, on the port its shard listens on. One router, never two at once (it owns the
    shards' KV; a router that connects clears them). The shards outlive the router's drain."""
    path = KUBERNETES / "shard-groups.yaml"
    docs = [doc for p, doc in manifests() if p == path]
    (statefulset,) = [doc for doc in docs if doc["kind"] == "StatefulSet"]
    (deployment,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    name, service = statefulset["metadata"]["name"], statefulset["spec"]["serviceName"]
    assert statefulset["spec"]["replicas"] >= 2, "several groups"
    assert statefulset["spec"].get("podManagementPolicy") == "Parallel", "every group loads at once"
    found = [
        (pod, container, process) for pod, container, process in all_processes() if pod.where.startswith(path.name)
    ]
    (shard,) = [(pod, c, p) for pod, c, p in found if pod.kind == "StatefulSet"]
    (router,) = [(pod, c, p) for pod, c, p in found if pod.kind == "Deployment"]
    shard_pod, shard_container, shard_process = shard
    router_pod, _, router_process = router
    assert shard_process.script == "conveyor-shard" and shard_process.flags.num_shard == 1, shard_process.where
    assert router_process.script == "conveyor-router", router_process.where

    # Each pod advertises its own stable name, $(POD_NAME).<serviceName>, POD_NAME being the pod's name.
    raw = [*shard_container.get("command", []), *shard_container.get("args", [])]
    advertised = raw[raw.index("--advertise-host") + 1]
    assert advertised == f"$(POD_NAME).{service}", f"{shard_process.where}: --advertise-host {advertised}"
    env = {e["name"]: e for e in shard_container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"

    port = shard_process.shard_ports[0]
    expected = [f"tcp://{name}-{i}.{service}:{port}" for i in range(statefulset["spec"]["replicas"])]
    assert group_addresses(router_process.flags) == expected, (
        f"{router_process.where}: --shard-address and --shard-groups name {group_addresses(router_process.flags)}, "
        f"the StatefulSet's groups are {expected}"
    )
    for flag in ("shard_tls_cert", "shard_tls_key", "shard_tls_ca"):  # one TLS set for all, or none
        assert getattr(router_process.flags, flag) == getattr(shard_process.flags, flag), flag
    assert router_process.flags.model_id == shard_process.flags.model_id, "validation reads the groups' model"

    assert deployment["spec"]["replicas"] == 1, "one router drives the groups"
    assert deployment["spec"]["strategy"]["type"] == "Recreate", "never two routers at once, not even in a rollout"
    drain = pre_stop_seconds(router[1]) + router_process.flags.graceful_termination_timeout + FLUSH_SECONDS
    assert pre_stop_seconds(shard_container) >= drain, f"{shard_process.where}: stops before the router's drain ends"
    assert router_pod.annotations.get("prometheus.io/scrape") == "true"
    # Only the router reaches the shards.
    for doc in docs:
        if (
            doc["kind"] == "NetworkPolicy"
            and doc["spec"]["podSelector"]["matchLabels"].items() <= shard_pod.labels.items()
        ):
            for rule in doc["spec"]["ingress"]:
                sources = [s["podSelector"]["matchLabels"] for s in rule.get("from", [])]
                assert sources and all(s.items() <= router_pod.labels.items() for s in sources), doc["metadata"]
                assert {p["port"] for p in rule["ports"]} <= set(shard_process.shard_ports), doc["metadata"]


def test_volume_claims_exist() -> None:
    claims = {doc["metadata"]["name"] for _, doc in manifests() if doc["kind"] == "PersistentVolumeClaim"}
    for pod in pods():
        for volume in pod.spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, pod.where


def _target_port(port: dict, container: dict) -> int:
    """A Service port's targetPort as a number: a name is the container's port of that name."""
    target = port["targetPort"]
    if isinstance(target, str):
        target = {p.get("name"): p["containerPort"] for p in container["ports"]}[target]
    return target
