"""The deployment files agree with the code, and the systemd protocol works for real:
the unit passes ``systemd-analyze verify``, READY=1 / STOPPING=1 / WATCHDOG=1 arrive on a
real datagram socket, the Dockerfile's commands run and pass their own health check, and
the Kubernetes manifests' ports, probes, commands and addresses match the package."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._config import _VARIABLES as CLIENT_SETTING_VARIABLES
from pjrt_rendezvous.client._topology import DEFAULT_PORT
from pjrt_rendezvous.coordinator import _cli, _notify
from pjrt_rendezvous.coordinator._server import FINAL_WRITE_TIMEOUT

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_cli import Serve, clean_env, run_cli  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "pjrt-rendezvous.service"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
(SCRIPT_NAME,) = PYPROJECT["project"]["scripts"]
CONSOLE_SCRIPT = pathlib.Path(sys.executable).with_name(SCRIPT_NAME)

# Variables the client reads (topology and settings), which deploy files may set too.
CLIENT_VARIABLES = set(CLIENT_SETTING_VARIABLES.values()) | {
    "PJRT_RENDEZVOUS_ADDRESS", "PJRT_RENDEZVOUS_TASK_ID", "PJRT_RENDEZVOUS_NUM_TASKS",
    "PJRT_RENDEZVOUS_CORES_PER_CHIP", "PJRT_RENDEZVOUS_LOCAL_RANK", "PJRT_RENDEZVOUS_LOCAL_WORLD_SIZE",
}
SERVE_VARIABLES = set(_cli.SERVE_VARIABLES.values()) | {_cli.TOKEN_VARIABLE}
KNOWN_VARIABLES = SERVE_VARIABLES | CLIENT_VARIABLES | {_cli.TLS_SERVER_NAME_VARIABLE}


def parse_cli(argv: list[str], env: dict[str, str] | None = None):
    """The argparse namespace the real CLI gives ``argv`` (SystemExit if it refuses)."""
    return _cli._parser(env or {}).parse_args(argv)


# -- systemd --------------------------------------------------------------------------------


def unit_entries(path: pathlib.Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file as {section: [(key, value), ...]} (repeated keys kept in order)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def test_unit_passes_systemd_analyze_verify(tmp_path):
    """`systemd-analyze verify` accepts the unit (its ExecStart pointed at this environment's
    console script, which must exist), and `systemd-analyze security` rates it 2.0 or better."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    assert CONSOLE_SCRIPT.exists(), CONSOLE_SCRIPT
    text = UNIT.read_text()
    assert "ExecStart=/opt/pjrt-rendezvous/bin/pjrt-rendezvous serve" in text
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace("/opt/pjrt-rendezvous/bin/pjrt-rendezvous", str(CONSOLE_SCRIPT)))
    verify = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert UNIT.name not in verify.stderr, verify.stderr  # no warnings about our unit either
    security = subprocess.run(
        [analyze, "security", "--offline=yes", str(unit)], capture_output=True, text=True, timeout=60
    )
    if security.returncode == 0:  # older systemd-analyze versions have no offline check
        exposure = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", security.stdout).group(1))
        assert exposure <= 2.0, security.stdout


def test_unit_agrees_with_the_cli():
    """The unit runs `serve` (as the CLI parses it) with Type=notify, restarts unless stopped,
    keeps the state file in its StateDirectory, reads an environment file, sets only
    variables serve knows, stops later than serve's grace, and is hardened."""
    entries = unit_entries(UNIT)
    service = dict(entries["Service"])
    assert service["Type"] == "notify" and service["Restart"] == "always" and service["RestartPreventExitStatus"] == "2"
    program, *args = shlex.split(service["ExecStart"])
    assert pathlib.Path(program).name == SCRIPT_NAME
    environment = dict(v.split("=", 1) for k, v in entries["Service"] if k == "Environment")
    parsed = parse_cli(args, environment)
    assert parsed.command == "serve" and parsed.port == DEFAULT_PORT and parsed.host == "0.0.0.0"
    pjrt = {k for k in environment if k.startswith("PJRT_")}
    assert pjrt <= SERVE_VARIABLES, pjrt - SERVE_VARIABLES
    state_dir = service["StateDirectory"]
    assert environment["PJRT_RENDEZVOUS_STATE_FILE"].startswith(f"%S/{state_dir}/")
    assert service["EnvironmentFile"] == "-/etc/pjrt-rendezvous/coordinator.env"
    assert float(service["TimeoutStopSec"].rstrip("s")) > parsed.grace + FINAL_WRITE_TIMEOUT
    assert float(service["WatchdogSec"].rstrip("s")) >= 10  # fed every WatchdogSec/2 by serve
    for key, wanted in {
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "DynamicUser": "yes", "CapabilityBoundingSet": "", "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX AF_NETLINK",
    }.items():
        assert service[key] == wanted, key
    assert dict(entries["Install"])["WantedBy"] == "multi-user.target"


def test_environment_file_and_install_script():
    """The example environment file names only variables serve reads; install.sh is valid
    bash and installs the files of this folder."""
    names = re.findall(r"^#?(PJRT_RENDEZVOUS_[A-Z_]+)=", (DEPLOY / "systemd" / "coordinator.env").read_text(), re.M)
    assert names and set(names) <= SERVE_VARIABLES, set(names) - SERVE_VARIABLES
    script = DEPLOY / "systemd" / "install.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    text = script.read_text()
    assert "pjrt-rendezvous.service" in text and "coordinator.env" in text
    # (it waits through Type=notify, not by reading coordinator.env as shell for `health`)
    assert "systemctl restart pjrt-rendezvous.service" in text and ". \"$CONFIG/coordinator.env\"" not in text


def _short_socket_dir() -> pathlib.Path:
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    return pathlib.Path(tempfile.mkdtemp(prefix="pjrt-notify-", dir="/tmp"))


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + address[1:] if address.startswith("@") else address)
    sock.settimeout(30)
    return sock


def _messages_until(sock: socket.socket, wanted: str, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        message = sock.recv(4096).decode()
        seen.append(message)
        if wanted in message.split("\n"):
            return seen
    raise AssertionError(f"{wanted} never arrived; got {seen}")


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_ready_and_stopping_reach_a_real_notify_socket(kind):
    """The real `pjrt-rendezvous serve` console script with NOTIFY_SOCKET (a path, or an abstract '@' name) sends READY=1 once
    it answers health checks, and STOPPING=1 when SIGTERM arrives, then exits 0."""
    folder = _short_socket_dir()
    address = str(folder / "notify") if kind == "path" else f"@pjrt-rendezvous-test-{uuid.uuid4().hex}"
    with _receiver(address) as sock:
        try:
            with Serve(env={"NOTIFY_SOCKET": address}, program=[str(CONSOLE_SCRIPT)]) as server:
                (ready,) = _messages_until(sock, "READY=1")
                status = f"STATUS=serving on 127.0.0.1:{server.port} (session port {server.session_port})"
                assert status in ready.split("\n")
                health = run_cli("health", "--address", server.address, "--timeout", "5")
                assert health.returncode == 0, health.stderr
                server.terminate()
                stopping = _messages_until(sock, "STOPPING=1")
                assert any(m.startswith("STOPPING=1\nSTATUS=stopping") for m in stopping)
                assert server.stop() == 0
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def test_watchdog_keepalives_when_systemd_asks_for_them():
    """With WATCHDOG_USEC set (WatchdogSec=), serve sends WATCHDOG=1 every half interval."""
    folder = _short_socket_dir()
    address = str(folder / "notify")
    with _receiver(address) as sock:
        try:
            with Serve(env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"}) as server:
                _messages_until(sock, "READY=1")
                started = time.monotonic()
                _messages_until(sock, "WATCHDOG=1")
                _messages_until(sock, "WATCHDOG=1")
                _messages_until(sock, "WATCHDOG=1")
                assert time.monotonic() - started < 5
                assert server.stop() == 0
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def test_notify_is_a_no_op_outside_systemd():
    """Without NOTIFY_SOCKET nothing is sent; an unsupported or dead socket is reported, not raised."""
    assert _notify.notify("READY=1", environ={}) is False
    assert _notify.notify("READY=1", environ={"NOTIFY_SOCKET": "vsock:2:1234"}) is False
    assert _notify.notify("READY=1", environ={"NOTIFY_SOCKET": "/nonexistent/notify"}) is False
    assert _notify.watchdog_interval({}) is None
    assert _notify.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert _notify.watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None


# -- Dockerfile -----------------------------------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile as stages of (INSTRUCTION, arguments), continuation lines joined."""
    logical, pending = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if (not line or line.startswith("#")) and not pending:
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[list[tuple[str, str]]] = []
    for line in logical:
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction.upper(), rest.strip()))
        else:
            assert instruction.upper() == "ARG", line
    return stages


def exec_form(text: str) -> list[str]:
    value = ast.literal_eval(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
    return value


def image_env(stage) -> dict[str, str]:
    env = {}
    for instruction, rest in stage:
        if instruction == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def test_dockerfile_agrees_with_the_package():
    """Multi-stage; the final stage runs the console script from pyproject as a non-root
    user, exposes DEFAULT_PORT, keeps the state file on the volume, configures serve only
    through variables it knows, and its HEALTHCHECK is the CLI's `health` command."""
    stages = dockerfile_stages()
    assert len(stages) >= 2
    final = dict((i, r) for i, r in stages[-1] if i not in ("ENV", "RUN", "COPY"))
    build = stages[0]
    copied = {r.split()[0] for i, r in build if i == "COPY"} | {
        s for i, r in build if i == "COPY" for s in r.split()[:-1]
    }
    packages = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert packages | {"pyproject.toml", "README.md"} <= copied
    assert not any("torch" in r for i, r in build + stages[-1] if i == "RUN")

    user = final["USER"].split(":")[0]
    assert user not in ("root", "0")
    entrypoint = exec_form(final["ENTRYPOINT"])
    assert entrypoint == [SCRIPT_NAME]
    command = exec_form(final["CMD"])
    env = image_env(stages[-1])
    assert {k for k in env if k.startswith("PJRT_")} <= SERVE_VARIABLES
    serve = parse_cli(command, env)
    assert serve.command == "serve" and serve.port == DEFAULT_PORT and serve.host == "0.0.0.0"
    assert final["EXPOSE"].split() == [str(DEFAULT_PORT), str(_cli.session_port(serve))]
    (volume,) = exec_form(final["VOLUME"])
    assert str(serve.state_file).startswith(volume + "/")

    flags, _, health_command = final["HEALTHCHECK"].partition(" CMD ")
    health = exec_form(health_command)
    assert health[0] == SCRIPT_NAME
    parsed = parse_cli(health[1:], env)
    assert parsed.command == "health" and parsed.address is None  # i.e. this container
    assert _cli.local_address(env) == f"127.0.0.1:{DEFAULT_PORT}"
    timeout = float(re.search(r"--timeout=(\d+)s", flags).group(1))
    assert parsed.timeout < timeout  # the check answers before Docker gives up on it

    ignored = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert not set(ignored) & (packages | {"pyproject.toml", "README.md"})


def test_image_commands_serve_and_pass_their_own_healthcheck(tmp_path):
    """ENTRYPOINT + CMD run with the image's environment (host, port and state folder swapped
    for loopback, a free port and a temporary folder) serve, and the HEALTHCHECK command,
    run with that environment, exits 0; after a stop it exits 1."""
    stages = dockerfile_stages()
    final = dict((i, r) for i, r in stages[-1] if i not in ("ENV", "RUN", "COPY"))
    env = {k: v for k, v in image_env(stages[-1]).items() if k != "PATH"}
    env.update(PJRT_RENDEZVOUS_HOST="127.0.0.1", PJRT_RENDEZVOUS_PORT="0",
               PJRT_RENDEZVOUS_STATE_FILE=str(tmp_path / "coordinator.state"))
    entrypoint, command = exec_form(final["ENTRYPOINT"]), exec_form(final["CMD"])
    assert entrypoint == [SCRIPT_NAME] and command[0] == "serve"
    with Serve(*command[1:], env=env, port_flag=False, program=[str(CONSOLE_SCRIPT)]) as server:
        health = exec_form(final["HEALTHCHECK"].partition(" CMD ")[2])
        probe_env = clean_env(**{**env, "PJRT_RENDEZVOUS_PORT": str(server.port)})
        ok = subprocess.run([str(CONSOLE_SCRIPT), *health[1:]], env=probe_env, capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        assert (tmp_path / "coordinator.state").exists()
        assert server.stop() == 0
    down = subprocess.run([str(CONSOLE_SCRIPT), *health[1:]], env=probe_env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 1


# -- Kubernetes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifests():
    yaml = pytest.importorskip("yaml")
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def one(manifests, kind: str, name: str) -> dict:
    (found,) = [d for _, d in manifests if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def plain_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_kubernetes_manifests_parse_and_are_complete(manifests):
    """Every document has apiVersion, kind, name and namespace; the coordinator, its
    Service and volume, the example Job and its headless Service are there."""
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in manifests}
    assert {
        ("Service", "pjrt-coordinator"), ("Deployment", "pjrt-coordinator"),
        ("PersistentVolumeClaim", "pjrt-coordinator-state"), ("Job", "train"), ("Service", "train-workers"),
        ("ConfigMap", "train-script"), ("PodMonitoring", "pjrt-coordinator"),
    } <= kinds
    for _, d in manifests:
        assert d["apiVersion"] and d["metadata"]["namespace"] == "default"


def test_coordinator_deployment_agrees_with_the_code(manifests):
    """One replica, Recreate; the container runs `serve` as the CLI parses it with the
    manifest's variables; gRPC probes, the named port, the Service and DEFAULT_PORT agree;
    metrics port and PodMonitoring agree; the state file is on the volume; non-root as the image."""
    deployment = one(manifests, "Deployment", "pjrt-coordinator")
    service = one(manifests, "Service", "pjrt-coordinator")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = pod["containers"]
    env = plain_env(container)
    assert set(e["name"] for e in container["env"]) <= KNOWN_VARIABLES
    serve = parse_cli(container["args"], env)
    assert serve.command == "serve" and serve.port == DEFAULT_PORT and serve.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == serve.port and ports["metrics"] == serve.metrics_port
    assert ports["session"] == _cli.session_port(serve)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == serve.port, probe
        assert "service" not in container[probe]["grpc"]  # the server-wide status, which serve sets
    # Clients dial the session port on the Service's address: the same number there.
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert service_ports.keys() == {"grpc", "session"}
    assert service_ports["grpc"]["port"] == DEFAULT_PORT and service_ports["grpc"]["targetPort"] == "grpc"
    assert service_ports["session"]["port"] == ports["session"] and service_ports["session"]["targetPort"] == "session"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert str(serve.state_file).startswith(mounts["state"] + "/")
    claim = volumes["state"]["persistentVolumeClaim"]["claimName"]
    one(manifests, "PersistentVolumeClaim", claim)
    docker_user = dict((i, r) for i, r in dockerfile_stages()[-1])["USER"].split(":")[0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == docker_user
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["terminationGracePeriodSeconds"] > serve.grace
    monitoring = one(manifests, "PodMonitoring", "pjrt-coordinator")
    assert monitoring["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [e["port"] for e in monitoring["spec"]["endpoints"]] == ["metrics"]


def test_no_service_link_variable_can_clash_with_ours(manifests):
    """Kubernetes injects <SERVICE>_PORT=tcp://... into pods: no Service name may produce a
    PJRT_RENDEZVOUS_ prefix, and every pod turns the links off anyway."""
    for _, d in manifests:
        if d["kind"] == "Service":
            prefix = d["metadata"]["name"].upper().replace("-", "_") + "_"
            assert not prefix.startswith("PJRT_RENDEZVOUS"), d["metadata"]["name"]
        pod = d.get("spec", {}).get("template", {}).get("spec")
        if pod is not None:
            assert pod["enableServiceLinks"] is False, d["metadata"]["name"]


def test_training_job_finds_the_coordinator_by_dns_and_uses_the_client(manifests):
    """The Job's PJRT_RENDEZVOUS_ADDRESS is <service>.<namespace>.svc:<port> of the
    coordinator's Service and parses as the client's address; the Job is Indexed with the
    headless Service as subdomain (so GKE sets TPU_WORKER_ID/HOSTNAMES); its script compiles
    and calls only the client's public API; both sides read the same token Secret."""
    service = one(manifests, "Service", "pjrt-coordinator")
    job = one(manifests, "Job", "train")
    headless = one(manifests, "Service", "train-workers")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = plain_env(container)
    assert set(e["name"] for e in container["env"]) <= KNOWN_VARIABLES | {"PJRT_DEVICE"}
    grpc_port = {p["name"]: p for p in service["spec"]["ports"]}["grpc"]
    wanted = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{grpc_port['port']}"
    assert env["PJRT_RENDEZVOUS_ADDRESS"] == wanted
    assert pr.detect_topology({"PJRT_RENDEZVOUS_ADDRESS": wanted}).address == wanted
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == job["spec"]["completions"] > 1
    assert pod["subdomain"] == headless["metadata"]["name"] and headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert "google.com/tpu" in container["resources"]["limits"]

    (volume,) = pod["volumes"]
    (mount,) = container["volumeMounts"]
    script_map = one(manifests, "ConfigMap", volume["configMap"]["name"])
    program, script_path = container["command"]
    name = pathlib.PurePosixPath(script_path)
    assert str(name.parent) == mount["mountPath"]
    source = script_map["data"][name.name]
    tree = ast.parse(source)
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "pr"}
    assert used and used <= set(pr.__all__), used - set(pr.__all__)

    def token_ref(c):
        (ref,) = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "PJRT_RENDEZVOUS_TOKEN"]
        return ref["name"], ref["key"], ref["optional"]

    (coordinator,) = one(manifests, "Deployment", "pjrt-coordinator")["spec"]["template"]["spec"]["containers"]
    assert token_ref(coordinator) == token_ref(container) == ("pjrt-rendezvous-token", "token", True)


# -- documentation --------------------------------------------------------------------------


def test_commands_in_the_deploy_guides_parse():
    """Every `pjrt-rendezvous ...` command line in the deploy guides is one the CLI accepts."""
    checked = 0
    for path in [*DEPLOY.rglob("*.md"), ROOT / "Dockerfile"]:
        for match in re.finditer(r"pjrt-rendezvous ((?:serve|status|health)\b[^\n`\"|&)>]*)", path.read_text()):
            argv = shlex.split(match.group(1).split(" #")[0].replace("\\", ""))
            argv = [a for a in argv if not a.startswith("$")]
            try:
                parse_cli(argv)
            except SystemExit as exc:  # --help exits 0
                if exc.code == 0:
                    continue
                pytest.fail(f"{path.name}: `pjrt-rendezvous {match.group(1).strip()}` is refused by the CLI")
            checked += 1
    assert checked >= 10


def test_every_log_event_the_coordinator_writes_is_documented():
    """Every ``event`` a line of the coordinator's log can carry (its modules' and the
    session code it serves with) is named in deploy/README.md's Logs section, which says
    every line is named by one (some had none, and some were not listed)."""
    text = (DEPLOY / "README.md").read_text()
    section = text[text.index("### Logs") :]
    section = section[: section.index("\n#", len("### Logs"))]
    documented = set(re.findall(r"`([a-z_]+)`", section))
    sources = [*sorted((ROOT / "coordinator").glob("*.py")), ROOT / "client" / "_session.py"]
    written = {event for path in sources for event in re.findall(r'"event": "([a-z_]+)"', path.read_text())}
    assert len(written) > 20 and written <= documented, sorted(written - documented)
    unnamed = []  # and every line of the coordinator's own, from INFO up, carries one
    for path in sorted((ROOT / "coordinator").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in ("info", "warning", "error", "critical", "exception", "log"):
                continue
            if "log" not in ast.unparse(node.func.value).lower():
                continue
            extra = next((k.value for k in node.keywords if k.arg == "extra"), None)
            if extra is None or '"event"' not in ast.unparse(extra).replace("'", '"'):
                unnamed.append(f"{path.name}:{node.lineno}")
    assert not unnamed, unnamed
