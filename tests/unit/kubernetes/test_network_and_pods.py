"""The Kubernetes manifests (deploy/kubernetes) without a cluster, continued: network
policies, autoscaling and disruption budgets, restricted pods, threads per CPU, the GPU overlay,
an external Redis, committed secrets, and the Redis container's password."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.redis_server import redis_recipe
from tests.unit.kubernetes.manifests import (
    EXTERNAL_REDIS_URL,
    OVERLAYS,
    REDIS_PASSWORD,
    REDIS_PASSWORD_ENV,
    ROOT,
    Obj,
    container,
    container_env,
    copy_manifests,
    kustomize,
    matches,
    named,
    objects,
    pair_suffixes,
    pod_labels,
    pod_spec,
    processes,
    secret_data,
    selected,
    workloads,
)


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
        tokenizer, scheduler = found["tokenizer"], found["scheduler"]
        tokenizers = tokenizer.workload["metadata"]["name"]
        pairs = scheduler.workload["metadata"]["name"]
        assert reachable(docs, tokenizers, tokenizer.config.port) == {"anyone"}
        assert reachable(docs, tokenizers, tokenizer.config.http_port) == {"anyone"}
        every_pair_set = set()
        for suffix in pair_suffixes(found):
            pair_set = found[f"scheduler{suffix}"].workload["metadata"]["name"]
            every_pair_set.add(pair_set)
            assert reachable(docs, pair_set, found[f"scheduler{suffix}"].config.port) == {
                tokenizers
            }
            # A worker is driven over its pod's loopback; a decode worker also takes the KV
            # pushes of prefill pods (the base's set), and nobody else's.
            worker_port = found[f"worker{suffix}"].config.port
            assert reachable(docs, pair_set, worker_port) == ({pairs} if suffix else set())
            assert "cluster" in reachable(docs, pair_set, scheduler.config.metrics_port)
        # Redis: the processes given its URL, and only those.
        assert reachable(docs, "llmserve-redis", 6379) == {tokenizers, *every_pair_set}
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
            *(
                frozenset({found[f"scheduler{suffix}"].workload["metadata"]["name"]})
                for suffix in pair_suffixes(found)
            ),
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
    """docs/deployment.md's Kubernetes commands that make an overlay's secret files, run as
    written."""
    from services.tokenizer.access.keys import parse_key_file

    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "deployment.md").read_text(), re.S)
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
