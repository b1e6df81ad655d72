"""The Kubernetes manifests (deploy/kubernetes) are checked without a cluster: every overlay
renders with kustomize (`kubectl kustomize`, kustomize v5), every rendered object validates
against the Kubernetes API schemas in strict mode (kubernetes-validate: an unknown or
misspelt field fails), and the pods agree with the llmserve processes they run: each
container's arguments parse with the `llmserve` CLI and build its config from the container's
environment, probes reach ports the process opens, drains fit the grace periods, and
discovery, network policies and secrets line up."""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from services.cli import build_parser, command_of  # noqa: E402
from services.common.config_flags import config_from_args, env_name  # noqa: E402
from services.tokenizer.membership import DnsName  # noqa: E402
from tests.redis_server import redis_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("example", "gpu")
# The oldest Kubernetes the manifests claim (docs/deploy.md), and the newest with schemas.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# A helper variable, not a setting: the Redis URL is built from it ($(LLMSERVE_REDIS_PASSWORD)).
REDIS_PASSWORD_ENV = "LLMSERVE_REDIS_PASSWORD"

Obj = dict[str, Any]

# The values the tests put in the overlays' secret files.
INTERNAL_SECRET = "0f" * 32
REDIS_PASSWORD = "a1" * 32
API_KEYS = "k-admin-7d1e admin\nk-user-95c2 tenant=acme\n"
EXTERNAL_REDIS_URL = "rediss://llmserve:pw-3e9a@redis.example.com:6380"


def config_class(command: str) -> type:
    from services.scheduler.server_config import SchedulerServerConfig
    from services.tokenizer.config import TokenizerConfig
    from services.worker.config import WorkerConfig

    return {
        "tokenizer": TokenizerConfig,
        "scheduler": SchedulerServerConfig,
        "worker": WorkerConfig,
    }[command]


# --- rendering ---------------------------------------------------------------------------


def kustomize(directory: Path) -> list[Obj]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def write_secret_files(overlay: Path, redis: str) -> None:
    """What docs/deploy.md tells the user to create (values the tests can recognise)."""
    secrets = overlay / "secrets"
    (secrets / "stack.env").write_text(
        f"LLMSERVE_INTERNAL_SECRET={INTERNAL_SECRET}\n{redis}\n", encoding="utf-8"
    )
    (secrets / "api-keys.txt").write_text(API_KEYS, encoding="utf-8")


def copy_manifests(destination: Path) -> None:
    """deploy/kubernetes without a developer's own secret files."""

    def ignore(directory: str, names: list[str]) -> list[str]:
        if Path(directory).name == "secrets":
            return [name for name in names if name != ".gitignore"]
        return []

    shutil.copytree(MANIFESTS, destination, ignore=ignore)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes with the test secrets."""
    copy = tmp_path_factory.mktemp("manifests") / "kubernetes"
    copy_manifests(copy)
    for name in OVERLAYS:
        write_secret_files(copy / "overlays" / name, f"{REDIS_PASSWORD_ENV}={REDIS_PASSWORD}")
    return copy


@pytest.fixture(scope="module")
def rendered(tree: Path) -> dict[str, list[Obj]]:
    return {name: kustomize(tree / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="module")
def external_redis(tree: Path) -> list[Obj]:
    """The example overlay with the external-redis component, as docs/deploy.md shows."""
    overlay = tree / "overlays" / "example-external-redis"
    shutil.copytree(tree / "overlays" / "example", overlay)
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    kustomization["components"] = ["../../components/external-redis"]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    write_secret_files(overlay, f"LLMSERVE_REDIS_URL={EXTERNAL_REDIS_URL}")
    return kustomize(overlay)


# --- reading rendered objects ------------------------------------------------------------


def objects(docs: list[Obj], kind: str) -> list[Obj]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: list[Obj], kind: str, name: str) -> Obj:
    (found,) = [doc for doc in objects(docs, kind) if doc["metadata"]["name"] == name]
    return found


def workloads(docs: list[Obj]) -> list[Obj]:
    return [doc for doc in docs if doc["kind"] in ("Deployment", "StatefulSet")]


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def container(workload: Obj, name: str) -> Obj:
    (found,) = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    return found


def secret_data(docs: list[Obj]) -> dict[str, dict[str, str]]:
    return {
        secret["metadata"]["name"]: {
            key: base64.b64decode(value).decode() for key, value in secret["data"].items()
        }
        for secret in objects(docs, "Secret")
    }


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in env values, command and args: a known variable is
    replaced, $$ stands for $, anything else is left as written."""

    def value(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, text)


def container_env(docs: list[Obj], workload: Obj, spec: Obj, pod_name: str) -> dict[str, str]:
    """The environment the container starts with, in the pod named `pod_name`."""
    secrets = secret_data(docs)
    fields = {"metadata.name": pod_name, "metadata.namespace": workload["metadata"]["namespace"]}
    env: dict[str, str] = {}
    for variable in spec.get("env", []):
        if "value" in variable:
            env[variable["name"]] = expand(variable["value"], env)
        elif "secretKeyRef" in variable["valueFrom"]:
            ref = variable["valueFrom"]["secretKeyRef"]
            env[variable["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            env[variable["name"]] = fields[variable["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


@dataclass
class Process:
    """An llmserve container as the process inside it sees itself."""

    workload: Obj
    spec: Obj
    env: dict[str, str]
    argv: list[str]
    config: Any

    @property
    def command(self) -> str:
        return self.argv[0]


def parse(
    docs: list[Obj], workload: Obj, spec: Obj, monkeypatch: pytest.MonkeyPatch, ordinal: int = 0
) -> Process:
    """Parse the container's args with the `llmserve` CLI and build its config, with the
    container's environment in place (the flags' defaults read LLMSERVE_* variables)."""
    assert "command" not in spec, "llmserve containers run the image's `llmserve` entrypoint"
    pod_name = workload["metadata"]["name"]
    if workload["kind"] == "StatefulSet":
        pod_name = f"{pod_name}-{ordinal}"
    env = container_env(docs, workload, spec, pod_name)
    argv = [expand(arg, env) for arg in spec["args"]]
    assert not [arg for arg in argv if "$(" in arg], f"unresolved reference in {argv}"
    with monkeypatch.context() as patch:
        for name in [name for name in os.environ if name.startswith("LLMSERVE_")]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        args = build_parser(command_of(argv)).parse_args(argv)
    config = config_from_args(config_class(args.command), args)
    return Process(workload, spec, env, argv, config)


def processes(docs: list[Obj], monkeypatch: pytest.MonkeyPatch) -> dict[str, Process]:
    """Every llmserve container of the overlay, by command (one of each)."""
    found: dict[str, Process] = {}
    for workload in workloads(docs):
        for spec in pod_spec(workload)["containers"]:
            if spec["image"].split("/")[-1].startswith("llmserve"):
                process = parse(docs, workload, spec, monkeypatch)
                assert process.command not in found
                found[process.command] = process
    assert set(found) == {"tokenizer", "scheduler", "worker"}
    return found


def pre_stop_sleep_s(spec: Obj) -> int:
    command = spec["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return int(command[1])


def container_port(spec: Obj, port: int | str) -> int:
    """A port number, or the number of a named container port."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in spec.get("ports", []) if p["name"] == port]
    return int(number)


def matches(selector: Obj, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against labels."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


def selected(docs: list[Obj], selector: Obj) -> set[str]:
    """Names of the workloads whose pods `selector` selects."""
    return {w["metadata"]["name"] for w in workloads(docs) if matches(selector, pod_labels(w))}


# --- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_api_schema(
    rendered: dict[str, list[Obj]], external_redis: list[Obj], version: str
) -> None:
    for name, docs in [*rendered.items(), ("external-redis", external_redis)]:
        assert docs, name
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                path = ".".join(str(part) for part in error.path)
                where = f"{name}: {doc['kind']}/{doc['metadata']['name']}: {path}"
                pytest.fail(f"{where}: {error.message}")


def test_overlays_hold_the_whole_stack(rendered: dict[str, list[Obj]]) -> None:
    for name, docs in rendered.items():
        kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in docs}
        assert {
            ("Namespace", name_of_namespace(docs)),
            ("Deployment", "llmserve-tokenizer"),
            ("Service", "llmserve-tokenizer"),
            ("HorizontalPodAutoscaler", "llmserve-tokenizer"),
            ("PodDisruptionBudget", "llmserve-tokenizer"),
            ("StatefulSet", "llmserve-pair"),
            ("Service", "llmserve-pair"),
            ("PodDisruptionBudget", "llmserve-pair"),
            ("Deployment", "llmserve-redis"),
            ("Service", "llmserve-redis"),
        } <= kinds, name
        for doc in docs:
            if doc["kind"] in ("Namespace", "Secret"):
                continue
            assert doc["metadata"]["namespace"] == name_of_namespace(docs), doc["kind"]
            labels = doc["metadata"]["labels"]
            assert labels["app.kubernetes.io/part-of"] == "llmserve"
            assert {"app.kubernetes.io/name", "app.kubernetes.io/component"} <= set(labels)
        for workload in workloads(docs):
            assert pod_labels(workload)["app.kubernetes.io/part-of"] == "llmserve"
            assert selected(docs, workload["spec"]["selector"]) == {workload["metadata"]["name"]}


def name_of_namespace(docs: list[Obj]) -> str:
    (namespace,) = objects(docs, "Namespace")
    return namespace["metadata"]["name"]  # type: ignore[no-any-return]


def test_commands_parse_and_build_their_configs(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for docs in rendered.values():
        found = processes(docs, monkeypatch)
        # Secrets arrive by environment and land in the configs.
        for process in found.values():
            assert process.config.internal_secret == INTERNAL_SECRET
        redis_url = f"redis://:{REDIS_PASSWORD}@llmserve-redis:6379"
        assert found["tokenizer"].config.redis_url == redis_url
        assert found["scheduler"].config.redis_url == redis_url
        # Every LLMSERVE_* variable is a setting of its process (a typo would be ignored).
        for process in found.values():
            settings = {env_name(field) for field in process.config.__dataclass_fields__}
            for name in process.env:
                if name.startswith("LLMSERVE_"):
                    assert name in settings or name == REDIS_PASSWORD_ENV, (process.command, name)


def test_secrets_never_on_a_command_line(rendered: dict[str, list[Obj]]) -> None:
    secret_flags = {"--internal-secret", "--redis-url", "--api-key", "--admin-api-key"}
    for name, docs in rendered.items():
        for workload in workloads(docs):
            for spec in pod_spec(workload)["containers"]:
                words = [*spec.get("command", []), *spec.get("args", [])]
                assert not secret_flags & {word.split("=")[0] for word in words}, spec["name"]
        # No value appears outside the Secrets: references only.
        text = yaml.safe_dump_all([doc for doc in docs if doc["kind"] != "Secret"])
        for value in (INTERNAL_SECRET, REDIS_PASSWORD, "k-admin-7d1e", "k-user-95c2"):
            assert value not in text, name


def test_referenced_secrets_exist(
    rendered: dict[str, list[Obj]], external_redis: list[Obj]
) -> None:
    for name, docs in [*rendered.items(), ("external-redis", external_redis)]:
        secrets = secret_data(docs)
        for secret in secrets:
            # Generated from the overlay's files: the name carries a hash of the contents.
            assert re.fullmatch(r"llmserve-(secrets|api-keys)-[a-z0-9]{10}", secret), secret
        for workload in workloads(docs):
            spec = pod_spec(workload)
            for c in spec["containers"]:
                for variable in c.get("env", []):
                    ref = variable.get("valueFrom", {}).get("secretKeyRef")
                    if ref is not None:
                        assert ref["key"] in secrets.get(ref["name"], {}), (name, ref)
            for volume in spec.get("volumes", []):
                if "secret" in volume:
                    assert volume["secret"]["secretName"] in secrets, (name, volume)


def test_the_api_key_file_is_the_mounted_secret(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.tokenizer.access import parse_key_file

    for docs in rendered.values():
        tokenizer = processes(docs, monkeypatch)["tokenizer"]
        path = Path(tokenizer.config.api_key_file)
        (mount,) = [
            m for m in tokenizer.spec["volumeMounts"] if Path(m["mountPath"]) == path.parent
        ]
        (volume,) = [
            v for v in pod_spec(tokenizer.workload)["volumes"] if v["name"] == mount["name"]
        ]
        contents = secret_data(docs)[volume["secret"]["secretName"]][path.name]
        assert len(parse_key_file(contents)) == 2


def test_probes_reach_ports_the_processes_open(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for docs in rendered.values():
        found = processes(docs, monkeypatch)
        # The public and engine ports: kubelet's gRPC probes on the process's own port, which
        # listens on every interface (kubelet connects to the pod's IP).
        for command in ("tokenizer", "scheduler"):
            process = found[command]
            assert process.config.host == "0.0.0.0", command
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert process.spec[probe]["grpc"]["port"] == process.config.port, (command, probe)
            declared = {p["containerPort"] for p in process.spec["ports"]}
            assert {process.config.port, process.config.metrics_port} <= declared, command
        tokenizer = found["tokenizer"]
        assert tokenizer.config.http and tokenizer.config.http_port in {
            p["containerPort"] for p in tokenizer.spec["ports"]
        }
        # The worker listens on the pod's loopback only: it checks itself from inside, and its
        # scheduler calls it there.
        worker = found["worker"]
        address = f"{worker.config.host}:{worker.config.port}"
        assert worker.config.host == "127.0.0.1"
        assert "ports" not in worker.spec
        for probe in ("startupProbe", "livenessProbe"):
            command = worker.spec[probe]["exec"]["command"]
            assert command == ["python", "-m", "services.healthcheck", address], probe
        assert found["scheduler"].config.worker == address
        assert found["scheduler"].workload is worker.workload  # the same pod


def test_scheduler_waits_as_long_as_its_worker(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def window_s(probe: Obj) -> int:
        return int(probe["periodSeconds"] * probe["failureThreshold"])

    for docs in rendered.values():
        found = processes(docs, monkeypatch)
        # The scheduler is NOT_SERVING until its worker has loaded the model.
        worker = window_s(found["worker"].spec["startupProbe"])
        assert window_s(found["scheduler"].spec["startupProbe"]) >= worker
        assert window_s(found["tokenizer"].spec["startupProbe"]) >= worker


def test_drains_fit_the_grace_periods(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for docs in rendered.values():
        found = processes(docs, monkeypatch)
        # The drains are set on the command lines, not left to defaults that could move.
        for process in found.values():
            assert "--drain-s" in process.argv, process.command
        for process in found.values():
            grace = pod_spec(process.workload)["terminationGracePeriodSeconds"]
            # SIGTERM comes after the preStop hook; the drain must end before SIGKILL.
            assert pre_stop_sleep_s(process.spec) + process.config.drain_s < grace, process.command
        scheduler, worker = found["scheduler"], found["worker"]
        # Both hooks start together: the worker is told to stop only once its scheduler has
        # drained, so the scheduler's last streams still get their steps.
        assert pre_stop_sleep_s(worker.spec) > (
            pre_stop_sleep_s(scheduler.spec) + scheduler.config.drain_s
        )


def test_headless_service_lists_ready_pairs_on_the_scheduler_port(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for docs in rendered.values():
        scheduler = processes(docs, monkeypatch)["scheduler"]
        pairs = scheduler.workload
        service = named(docs, "Service", pairs["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is False
        assert selected(docs, {"matchLabels": service["spec"]["selector"]}) == {
            pairs["metadata"]["name"]
        }
        (engine,) = [p for p in service["spec"]["ports"] if p["name"] == "engine"]
        assert engine["port"] == scheduler.config.port
        assert container_port(scheduler.spec, engine["targetPort"]) == scheduler.config.port


def test_tokenizers_discover_the_pairs_by_dns(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for docs in rendered.values():
        found = processes(docs, monkeypatch)
        pairs = found["scheduler"].workload
        service = named(docs, "Service", pairs["spec"]["serviceName"])
        (engine,) = [p for p in service["spec"]["ports"] if p["name"] == "engine"]
        # One entry, `dns:NAME:PORT`: the tokenizer re-resolves NAME every
        # --scheduler-resolve-s seconds and routes over every address it gets.
        (entry,) = found["tokenizer"].config.scheduler_entries
        assert isinstance(entry, DnsName)
        # The Service's name alone resolves within the namespace (the pod's DNS search path).
        assert entry.name == service["metadata"]["name"]
        assert entry.port == engine["port"]


def test_each_pair_has_its_own_scheduler_id(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for docs in rendered.values():
        pairs = named(docs, "StatefulSet", "llmserve-pair")
        spec = container(pairs, "scheduler")
        ids = {
            parse(docs, pairs, spec, monkeypatch, ordinal).config.scheduler_id
            for ordinal in range(3)
        }
        assert ids == {"llmserve-pair-0", "llmserve-pair-1", "llmserve-pair-2"}


def reachable(docs: list[Obj], target: str, port: int) -> set[str]:
    """Who may connect to `port` of workload `target`'s pods under the overlay's
    NetworkPolicies: names of the stack's workloads, "cluster" (any pod of any namespace) or
    "anyone"."""
    labels = pod_labels(named(docs, kind_of(docs, target), target))
    policies = [
        policy
        for policy in objects(docs, "NetworkPolicy")
        if matches(policy["spec"]["podSelector"], labels)
    ]
    assert policies, f"no NetworkPolicy selects {target}: every port open"
    sources: set[str] = set()
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
                continue
            if "from" not in rule:
                sources.add("anyone")
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    sources.add("cluster")
                else:
                    sources |= selected(docs, peer["podSelector"])
    return sources


def kind_of(docs: list[Obj], name: str) -> str:
    (kind,) = [w["kind"] for w in workloads(docs) if w["metadata"]["name"] == name]
    return kind  # type: ignore[no-any-return]


def test_network_policies_keep_internal_ports_internal(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for docs in rendered.values():
        found = processes(docs, monkeypatch)
        tokenizer, scheduler, worker = found["tokenizer"], found["scheduler"], found["worker"]
        tokenizers = tokenizer.workload["metadata"]["name"]
        pairs = scheduler.workload["metadata"]["name"]
        assert reachable(docs, tokenizers, tokenizer.config.port) == {"anyone"}
        assert reachable(docs, tokenizers, tokenizer.config.http_port) == {"anyone"}
        assert reachable(docs, pairs, scheduler.config.port) == {tokenizers}
        assert reachable(docs, pairs, worker.config.port) == set()
        # Redis: the processes given its URL, and only those.
        assert reachable(docs, "llmserve-redis", 6379) == {tokenizers, pairs}
        for process in (tokenizer, scheduler):
            assert process.config.redis_url.endswith("@llmserve-redis:6379")
        service = named(docs, "Service", "llmserve-redis")
        assert selected(docs, {"matchLabels": service["spec"]["selector"]}) == {"llmserve-redis"}
        assert [p["port"] for p in service["spec"]["ports"]] == [6379]
        # Prometheus, wherever it runs in the cluster, reaches the metrics ports.
        assert "cluster" in reachable(docs, tokenizers, tokenizer.config.metrics_port)
        assert "cluster" in reachable(docs, pairs, scheduler.config.metrics_port)


def test_autoscaler_and_disruption_budgets(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for docs in rendered.values():
        found = processes(docs, monkeypatch)
        tokenizers = found["tokenizer"].workload
        hpa = named(docs, "HorizontalPodAutoscaler", "llmserve-tokenizer")
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", tokenizers["metadata"]["name"])
        assert 1 < hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        (metric,) = hpa["spec"]["metrics"]
        assert metric["resource"]["name"] == "cpu"
        # Utilisation is a share of the request; and a fixed count would fight the HPA.
        assert "cpu" in found["tokenizer"].spec["resources"]["requests"]
        assert "replicas" not in tokenizers["spec"]
        budgets = {
            frozenset(selected(docs, pdb["spec"]["selector"]))
            for pdb in objects(docs, "PodDisruptionBudget")
        }
        assert budgets == {
            frozenset({tokenizers["metadata"]["name"]}),
            frozenset({found["scheduler"].workload["metadata"]["name"]}),
        }


def test_pods_run_restricted(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, docs in rendered.items():
        namespace = objects(docs, "Namespace")[0]
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == (
            "restricted"
        )
        for workload in workloads(docs):
            spec = pod_spec(workload)
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            assert spec["automountServiceAccountToken"] is False
            # Service links would add LLMSERVE_*_PORT variables where llmserve reads settings.
            assert spec["enableServiceLinks"] is False
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for c in spec["containers"]:
                security = c["securityContext"]
                assert security["readOnlyRootFilesystem"] is True, (name, c["name"])
                assert security["allowPrivilegeEscalation"] is False
                assert security["capabilities"] == {"drop": ["ALL"]}
                for bound in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(c["resources"][bound]), (c["name"], bound)
                for mount in c.get("volumeMounts", []):
                    assert "emptyDir" in volumes[mount["name"]] or mount.get("readOnly")
        # What the processes write goes to emptyDirs: HOME, /tmp and the worker's caches.
        for process in processes(docs, monkeypatch).values():
            writable = {
                m["mountPath"] for m in process.spec["volumeMounts"] if not m.get("readOnly")
            }
            assert "/tmp" in writable and process.env["HOME"] in writable
            for variable in ("XDG_CACHE_HOME", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR"):
                if variable in process.env:
                    assert any(process.env[variable].startswith(p) for p in writable), variable
            if process.command == "worker":
                assert "XDG_CACHE_HOME" in process.env


def test_worker_threads_match_its_cpus(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for docs in rendered.values():
        worker = processes(docs, monkeypatch)["worker"]
        limits = worker.spec["resources"]["limits"]
        assert worker.config.threads == int(limits["cpu"])
        assert worker.spec["resources"]["requests"]["cpu"] == limits["cpu"]


def test_gpu_overlay_puts_each_worker_on_a_gpu(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = processes(rendered["gpu"], monkeypatch)["worker"]
    assert worker.config.device == "cuda"
    for bound in ("requests", "limits"):
        assert int(worker.spec["resources"][bound]["nvidia.com/gpu"]) == 1
    spec = pod_spec(worker.workload)
    assert spec["nodeSelector"]
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    # Only the worker holds the device; the CPU overlay asks for none.
    for c in spec["containers"]:
        if c["name"] != "worker":
            assert "nvidia.com/gpu" not in c["resources"]["limits"]
    cpu_worker = processes(rendered["example"], monkeypatch)["worker"]
    assert cpu_worker.config.device == "cpu"
    assert "nvidia.com/gpu" not in cpu_worker.spec["resources"]["limits"]


def test_external_redis_replaces_the_stacks_redis(
    external_redis: list[Obj], monkeypatch: pytest.MonkeyPatch
) -> None:
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in external_redis}
    assert not [name for kind, name in names if "redis" in name]
    found = processes(external_redis, monkeypatch)
    assert found["tokenizer"].config.redis_url == EXTERNAL_REDIS_URL
    assert found["scheduler"].config.redis_url == EXTERNAL_REDIS_URL
    for process in found.values():
        assert REDIS_PASSWORD_ENV not in process.env


def test_secret_values_are_never_committed() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(
        ["git", "ls-files", "deploy/kubernetes"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [
        path for path in tracked if "/secrets/" in path and not path.endswith(".gitignore")
    ] == []
    for overlay in OVERLAYS:
        for name in ("stack.env", "api-keys.txt"):
            path = f"deploy/kubernetes/overlays/{overlay}/secrets/{name}"
            ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
            assert ignored.returncode == 0, f"{path} is not git-ignored"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_the_documented_secret_recipe_renders(tmp_path: Path) -> None:
    """docs/deploy.md's commands that make an overlay's secret files, run as written."""
    from services.tokenizer.access import parse_key_file

    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "deploy.md").read_text(), re.S)
    (recipe,) = [block for block in blocks if "secrets/stack.env" in block]
    copy_manifests(tmp_path / "deploy" / "kubernetes")
    subprocess.run(["bash", "-euc", recipe], cwd=tmp_path, check=True, timeout=30)
    overlay = tmp_path / "deploy" / "kubernetes" / "overlays" / "example"
    secrets = secret_data(kustomize(overlay))
    (stack,) = [data for name, data in secrets.items() if name.startswith("llmserve-secrets")]
    for name in ("LLMSERVE_INTERNAL_SECRET", REDIS_PASSWORD_ENV):
        assert re.fullmatch(r"[0-9a-f]{64}", stack[name]), name  # URL-safe, no newline
    (keys,) = [data for name, data in secrets.items() if name.startswith("llmserve-api-keys")]
    assert [key.caller.admin for key in parse_key_file(keys["api-keys.txt"])] == [True, False]


def redis_command(connection: socket.socket, *words: str) -> bytes:
    connection.sendall(" ".join(words).encode() + b"\r\n")
    return connection.recv(256)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_the_redis_container_requires_its_password_and_hides_it(
    rendered: dict[str, list[Obj]],
) -> None:
    """The Redis container's command and probe, run here as the container's shell would (on
    loopback and a free port instead of the pod's 6379)."""
    docs = rendered["example"]
    redis = named(docs, "Deployment", "llmserve-redis")
    spec = container(redis, "redis")
    env = {**os.environ, **container_env(docs, redis, spec, "llmserve-redis")}
    assert env[REDIS_PASSWORD_ENV] == REDIS_PASSWORD
    shell, flag, script = spec["command"]
    assert (shell, flag) == ("sh", "-c") and "$(" not in script
    with redis_recipe(script, env) as (process, port):
        with socket.create_connection(("127.0.0.1", port), timeout=2) as connection:
            assert redis_command(connection, "AUTH", REDIS_PASSWORD).startswith(b"+OK")
            policy = redis_command(connection, "CONFIG", "GET", "maxmemory-policy")
            assert b"volatile-lru" in policy
        # exec: the shell became redis-server, whose command line has no password.
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert b"redis-server" in cmdline and REDIS_PASSWORD.encode() not in cmdline
        for probe in ("readinessProbe", "livenessProbe"):
            check = spec[probe]["exec"]["command"]
            assert check[:2] == ["sh", "-c"]
            script = check[2].replace("redis-cli ping", f"redis-cli -p {port} ping")
            assert subprocess.run(["sh", "-c", script], env=env, timeout=10).returncode == 0
            wrong = {**env, REDIS_PASSWORD_ENV: "wrong"}
            assert subprocess.run(["sh", "-c", script], env=wrong, timeout=10).returncode != 0
