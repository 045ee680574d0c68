"""docker-compose.yml validates offline and carries what the deployment promises."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _compose() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run(
            [docker, "compose", "version"], capture_output=True, check=False
        ).returncode
        == 0
    ):
        return [docker, "compose"]
    if os.environ.get("CI"):
        pytest.fail("docker-compose is not installed (.ci/run installs it)")
    pytest.skip("neither docker-compose nor the docker compose plugin is installed")


def test_compose_file_validates_with_gpu_reservations_and_aof() -> None:
    """`compose config` accepts the file: Redis with AOF everysec and a healthcheck, one worker per
    GPU with its device reservation and a `prefixq check` healthcheck, and a producer example."""
    p = subprocess.run(
        [*_compose(), "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    svc = cfg["services"]
    redis_cmd = " ".join(svc["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "--appendfsync everysec" in redis_cmd
    assert "healthcheck" in svc["redis"]
    for k in (0, 1):
        w = svc[f"worker-{k}"]
        (dev,) = w["deploy"]["resources"]["reservations"]["devices"]
        assert dev["device_ids"] == [str(k)] and dev["capabilities"] == ["gpu"]
        assert w["command"][:3] == ["worker", "--shard", str(k)]
        assert w["healthcheck"]["test"] == ["CMD", "prefixq", "check", "--shard", str(k)]
        assert w["environment"]["REDIS_URL"] == "redis://redis:6379/0"
    assert svc["producer"]["command"][0] == "submit"


def test_compose_serve_service_listens_with_keys_and_shares_a_files_volume() -> None:
    """The `serve` service runs `prefixq serve` on all interfaces (so it needs PREFIXQ_API_KEYS,
    taken from the environment), keeps files on a named volume and checks /health."""
    p = subprocess.run(
        [*_compose(), "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PREFIXQ_API_KEYS": "k1,k2=team"},
    )
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    svc = cfg["services"]["serve"]
    assert svc["command"][:3] == ["serve", "--host", "0.0.0.0"]
    assert svc["environment"]["PREFIXQ_API_KEYS"] == "k1,k2=team"
    assert svc["environment"]["PREFIXQ_FILES_DIR"] == "/files"
    (vol,) = svc["volumes"]  # docker-compose v1 prints "source:target:mode", v2 a mapping
    if isinstance(vol, str):
        vol = dict(zip(("source", "target"), vol.split(":"), strict=False))
    assert vol["target"] == "/files" and vol["source"] in cfg["volumes"]
    assert "/health" in " ".join(svc["healthcheck"]["test"])
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"


def test_compose_monitoring_profile_provisions_prometheus_and_grafana_with_the_dashboard() -> None:
    """`--profile monitoring` adds Prometheus scraping the workers with deploy/prometheus.yml and
    Grafana provisioned with its data source and deploy/grafana/prefixq.json; neither starts
    without the profile."""
    base = [*_compose(), "-f", str(ROOT / "docker-compose.yml")]
    p = subprocess.run(
        [*base, "--profile", "monitoring", "config"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    svc = yaml.safe_load(p.stdout)["services"]

    def mounts(name: str) -> dict[str, str]:
        out = {}
        for v in svc[name]["volumes"]:
            if isinstance(v, str):
                v = dict(zip(("source", "target"), v.split(":"), strict=False))
            out[v["target"]] = v["source"]
        return out

    prom, graf = mounts("prometheus"), mounts("grafana")
    assert Path(prom["/etc/prometheus/prometheus.yml"]) == ROOT / "deploy/prometheus.yml"
    assert Path(graf["/etc/grafana/provisioning"]) == ROOT / "deploy/grafana/provisioning"
    assert (
        Path(graf["/var/lib/grafana/dashboards/prefixq.json"])
        == ROOT / "deploy/grafana/prefixq.json"
    )
    assert svc["prometheus"]["profiles"] == svc["grafana"]["profiles"] == ["monitoring"]
    scrape = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())["scrape_configs"]
    targets = [t for job in scrape for sc in job["static_configs"] for t in sc["targets"]]
    # every worker service of the compose file, on the metrics port its environment sets
    workers = [n for n in svc if n.startswith("worker-")]
    port = svc["worker-0"]["environment"]["PREFIXQ_METRICS_PORT"]
    assert sorted(targets) == sorted(f"{n}:{port}" for n in workers)
    ds = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert ds["url"] == "http://prometheus:9090"
    dash = (ROOT / "deploy/grafana/prefixq.json").read_text()
    assert f'"uid": "{ds["uid"]}"' in dash
