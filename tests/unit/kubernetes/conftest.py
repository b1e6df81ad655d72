"""The rendered overlays, once for the package (kustomize takes a few seconds)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.unit.kubernetes.manifests import (
    EXTERNAL_REDIS_URL,
    OVERLAYS,
    REDIS_PASSWORD,
    REDIS_PASSWORD_ENV,
    Obj,
    copy_manifests,
    kustomize,
    write_secret_files,
    yaml,
)


@pytest.fixture(scope="package")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes with the test secrets."""
    copy = tmp_path_factory.mktemp("manifests") / "kubernetes"
    copy_manifests(copy)
    for name in OVERLAYS:
        write_secret_files(copy / "overlays" / name, f"{REDIS_PASSWORD_ENV}={REDIS_PASSWORD}")
    return copy


@pytest.fixture(scope="package")
def rendered(tree: Path) -> dict[str, list[Obj]]:
    return {name: kustomize(tree / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="package")
def external_redis(tree: Path) -> list[Obj]:
    """The example overlay with the external-redis component, as docs/deployment.md
    (Kubernetes) shows."""
    overlay = tree / "overlays" / "example-external-redis"
    shutil.copytree(tree / "overlays" / "example", overlay)
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    kustomization["components"] = ["../../components/external-redis"]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    write_secret_files(overlay, f"LLMSERVE_REDIS_URL={EXTERNAL_REDIS_URL}")
    return kustomize(overlay)
