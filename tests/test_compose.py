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


CLUSTER_NODES = [f"redis-node-{i}" for i in range(6)]


def test_compose_cluster_profile_runs_six_nodes_a_one_shot_create_and_workers_on_every_seed() -> (
    None
):
    """`--profile cluster` adds 6 Redis Cluster nodes (AOF everysec, noeviction, each announcing
    its service name), a one-shot `redis-cli --cluster create ... --cluster-replicas 1` that waits
    for all of them, and workers whose REDIS_URL names every node as a seed, started once the
    cluster is made, with min_replicas_acked=1; none of it starts without the profile."""
    base = [*_compose(), "-f", str(ROOT / "docker-compose.yml")]
    run = {"capture_output": True, "text": True, "check": False, "cwd": ROOT}
    plain = subprocess.run([*base, "config"], **run)
    assert plain.returncode == 0, plain.stderr
    plain_services = yaml.safe_load(plain.stdout)["services"]
    # docker-compose 1.x lists profiled services in a plain `config` too (the compose plugin
    # leaves them out): their `profiles` entry is what keeps them from starting without it
    for name in {*CLUSTER_NODES, "cluster-worker-0"} & set(plain_services):
        assert plain_services[name].get("profiles") == ["cluster"], name
    p = subprocess.run([*base, "--profile", "cluster", "config"], **run)
    assert p.returncode == 0, p.stderr
    svc = yaml.safe_load(p.stdout)["services"]
    for name in CLUSTER_NODES:
        cmd = " ".join(svc[name]["command"])
        for flag in (
            "--cluster-enabled yes",
            "--appendonly yes",
            "--appendfsync everysec",
            "--maxmemory-policy noeviction",
            f"--cluster-announce-hostname {name}",
        ):
            assert flag in cmd, f"{name}: {flag!r} missing from {cmd!r}"
        assert svc[name]["profiles"] == ["cluster"] and "healthcheck" in svc[name]
    init = svc["redis-cluster-init"]
    assert {n: c["condition"] for n, c in init["depends_on"].items()} == dict.fromkeys(
        CLUSTER_NODES, "service_healthy"
    )
    script = " ".join(init["command"])
    assert "--cluster create" in script and "--cluster-replicas 1" in script
    from prefixq.store.redis_url import seeds

    for k in (0, 1):
        w = svc[f"cluster-worker-{k}"]
        assert w["command"][:3] == ["worker", "--shard", str(k)]
        init_dep = w["depends_on"]["redis-cluster-init"]
        assert init_dep["condition"] == "service_completed_successfully"
        env = w["environment"]
        assert seeds(env["REDIS_URL"]) == [(n, 6379) for n in CLUSTER_NODES]
        assert env["PREFIXQ_MIN_REPLICAS_ACKED"] == "1"
        assert w["healthcheck"]["test"] == ["CMD", "prefixq", "check", "--shard", str(k)]


def test_compose_cluster_init_creates_the_cluster_from_the_nodes_addresses_once(
    tmp_path: Path,
) -> None:
    """The one-shot service's script, run by sh with stand-ins for `getent` and `redis-cli`:
    it asks redis-cli to create a cluster of the 6 nodes' addresses with one replica each; when
    redis-node-0 already says cluster_state:ok it creates nothing (a restart of the profile)."""
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    init = raw["redis-cluster-init"]
    assert init["entrypoint"] == ["sh", "-c"]
    (script,) = init["command"]
    script = script.replace("$$", "$")  # compose's escape for a literal $
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "getent").write_text('#!/bin/sh\nn="${2##*-}"; echo "10.0.0.$((n + 10))   $2"\n')
    (bin_dir / "redis-cli").write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n'
        'if [ "$3" = cluster ] && [ "$4" = info ]; then cat "$CLUSTER_INFO" 2>/dev/null; fi\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    create = calls.read_text().splitlines()[-1].split()
    addrs = [f"10.0.0.{10 + i}:6379" for i in range(6)]
    assert create == ["--cluster", "create", *addrs, "--cluster-replicas", "1", "--cluster-yes"]

    calls.unlink()
    info = tmp_path / "info"
    info.write_text("cluster_state:ok\ncluster_slots_assigned:16384\n")
    p = subprocess.run(
        ["sh", "-c", script],
        env={**env, "CLUSTER_INFO": str(info)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert [c.split()[2:] for c in calls.read_text().splitlines()] == [["cluster", "info"]]


def test_every_prefixq_check_healthcheck_outlasts_the_checks_own_timeout() -> None:
    """`prefixq check` against a Redis that accepts connections but does not answer says so after
    about 15 s (docs/operations.md, "Health check"); a healthcheck timeout of 10 s cut it off, and
    Docker showed "timed out" instead of the reason."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    checks = {
        name: svc["healthcheck"]
        for name, svc in services.items()
        if "check" in (svc.get("healthcheck") or {}).get("test", [])
    }
    assert checks
    for name, hc in checks.items():
        assert int(str(hc["timeout"]).rstrip("s")) >= 20, (name, hc)
