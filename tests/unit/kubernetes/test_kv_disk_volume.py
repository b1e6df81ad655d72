"""Every overlay's workers keep the KV disk tier on a volume of the pod (never the read-only
root filesystem), one worker per pod, so one per directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.kubernetes.manifests import Obj, pod_spec, processes


def test_every_worker_has_its_kv_disk_directory_on_a_writable_volume(
    rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for overlay, docs in rendered.items():
        workers = {k: p for k, p in processes(docs, monkeypatch).items() if k.startswith("worker")}
        for name, worker in workers.items():
            directory = worker.config.kv_disk_dir
            assert directory, (overlay, name)
            (mount,) = [
                m
                for m in worker.spec["volumeMounts"]
                if Path(directory).is_relative_to(m["mountPath"])
            ]
            assert not mount.get("readOnly"), (overlay, name)
            volumes = {v["name"]: v for v in pod_spec(worker.workload)["volumes"]}
            assert "emptyDir" in volumes[mount["name"]], (overlay, name)
            # No other container of the pod mounts it: the worker's alone.
            others = [c for c in pod_spec(worker.workload)["containers"] if c is not worker.spec]
            assert all(
                m["name"] != mount["name"] for c in others for m in c.get("volumeMounts", [])
            )
