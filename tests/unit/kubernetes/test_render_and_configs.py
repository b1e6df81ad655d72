"""The Kubernetes manifests (deploy/kubernetes) are checked without a cluster: every overlay
renders with kustomize (`kubectl kustomize`, kustomize v5), every rendered object validates
against the Kubernetes API schemas in strict mode (kubernetes-validate: an unknown or
misspelt field fails), and the pods agree with the llmserve processes they run: each
container's arguments parse with the `llmserve` CLI and build its config from the container's
environment, probes reach ports the process opens, drains fit the grace periods, and
discovery, network policies and secrets line up. This file: schemas,
overlays, commands and configs, secrets, probes, drains, discovery. The network, pods,
GPUs, external Redis and the Redis container: test_network_and_pods.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.common.config_flags import env_name
from services.tokenizer.routing.membership import DnsName
from tests.unit.kubernetes.manifests import (
    INTERNAL_SECRET,
    KUBERNETES_VERSIONS,
    POD_IP,
    REDIS_PASSWORD,
    REDIS_PASSWORD_ENV,
    Obj,
    container,
    container_port,
    kubernetes_validate,
    named,
    objects,
    pair_suffixes,
    parse,
    pod_labels,
    pod_spec,
    pre_stop_sleep_s,
    processes,
    secret_data,
    selected,
    workloads,
    yaml,
)

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
    from services.tokenizer.access.keys import parse_key_file

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
        # One entry per set of pairs, `dns:NAME:PORT`: the tokenizer re-resolves NAME every
        # --scheduler-resolve-s seconds and routes over every address it gets.
        entries = found["tokenizer"].config.scheduler_entries
        assert len(entries) == len(pair_suffixes(found))
        for entry, suffix in zip(entries, pair_suffixes(found), strict=True):
            pairs = found[f"scheduler{suffix}"].workload
            service = named(docs, "Service", pairs["spec"]["serviceName"])
            (engine,) = [p for p in service["spec"]["ports"] if p["name"] == "engine"]
            assert isinstance(entry, DnsName)
            # The Service's name alone resolves in the namespace (the pod's DNS search path).
            assert entry.name == service["metadata"]["name"]
            assert entry.port == engine["port"]
            # Each set's Service lists its own pods only.
            assert selected(docs, {"matchLabels": service["spec"]["selector"]}) == {
                pairs["metadata"]["name"]
            }


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


def test_the_disaggregated_overlay_has_prefill_and_decode_pairs(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/disaggregation.md: the base's pairs prefill, llmserve-pair-decode's decode; a
    decode scheduler names its worker at the pod's IP as the KV destination, and that worker
    listens there as well as on loopback (its scheduler's address); prefill workers stay on
    loopback."""
    found = processes(rendered["disaggregated"], monkeypatch)
    assert pair_suffixes(found) == ["", "-decode"]
    prefill, decode = found["scheduler"], found["scheduler-decode"]
    assert (prefill.config.role, decode.config.role) == ("prefill", "decode")
    decode_worker = found["worker-decode"].config
    assert decode_worker.host == "0.0.0.0"
    assert decode.config.worker == f"127.0.0.1:{decode_worker.port}"
    assert decode.config.worker_advertise_address == f"{POD_IP}:{decode_worker.port}"
    assert found["worker"].config.host == "127.0.0.1"
    assert prefill.config.worker_advertise_address == ""
    for name in ("example", "gpu"):
        assert processes(rendered[name], monkeypatch)["scheduler"].config.role == "both"
