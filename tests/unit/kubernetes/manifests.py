"""Rendering deploy/kubernetes without a cluster (kustomize) and reading what it renders:
objects by kind and name, pod specs, container environments, the llmserve processes the
containers run, selectors. Shared by the tests of tests/unit/kubernetes."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from services.cli import build_parser, command_of  # noqa: E402
from services.common.config_flags import config_from_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
MANIFESTS = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("example", "gpu", "disaggregated")
# The oldest Kubernetes the manifests claim (docs/deployment.md, Kubernetes), and the newest
# with schemas.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# A helper variable, not a setting: the Redis URL is built from it ($(LLMSERVE_REDIS_PASSWORD)).
REDIS_PASSWORD_ENV = "LLMSERVE_REDIS_PASSWORD"

Obj = dict[str, Any]

# The values the tests put in the overlays' secret files.
INTERNAL_SECRET = "0f" * 32
REDIS_PASSWORD = "a1" * 32
API_KEYS = "k-admin-7d1e admin\nk-user-95c2 tenant=acme\n"
POD_IP = "10.244.1.7"
"""What the downward API gives a container for status.podIP, in these tests."""
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
    """What docs/deployment.md (Kubernetes) tells the user to create (values the tests can
    recognise)."""
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
    fields = {
        "metadata.name": pod_name,
        "metadata.namespace": workload["metadata"]["namespace"],
        "status.podIP": POD_IP,
    }
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
        # A second set of pairs (the disaggregated overlay's llmserve-pair-decode) names its
        # processes by its suffix: scheduler-decode, worker-decode.
        suffix = ""
        if workload["metadata"]["name"].startswith("llmserve-pair-"):
            suffix = workload["metadata"]["name"].removeprefix("llmserve-pair")
        for spec in pod_spec(workload)["containers"]:
            if spec["image"].split("/")[-1].startswith("llmserve"):
                process = parse(docs, workload, spec, monkeypatch)
                assert process.command + suffix not in found
                found[process.command + suffix] = process
    assert {"tokenizer", "scheduler", "worker"} <= set(found)
    assert set(found) - {"tokenizer"} == {
        f"{c}{s}"
        for c in ("scheduler", "worker")
        for s in {k.removeprefix("scheduler") for k in found if k.startswith("scheduler")}
    }
    return found


def pair_suffixes(found: dict[str, Process]) -> list[str]:
    """The sets of pairs `processes` found: "" (the base's), and "-decode" where the overlay
    adds a decode set."""
    return sorted(key.removeprefix("scheduler") for key in found if key.startswith("scheduler"))


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
