"""deploy/k8s validates offline and runs what exists, as tests/test_compose.py checks compose.

No cluster here: the Kustomize tree is rendered by a small loader (resources and components, the
only fields it uses; `kubectl kustomize` must agree where it is installed). Every Kubernetes object
validates against the API's schemas of `K8S_VERSIONS` (the `kubernetes-validate` package, strict:
an unknown field is an error), the ScaledObject against KEDA's own CRD schema (tests/data, from
KEDA v2.20.2). Then what the pods run: every `prefixq` command line (container args after the
image's `prefixq` entrypoint, probe commands) parses with prefixq's own CLI parser, every PREFIXQ_*
name is a Settings field and the values are valid settings, ports agree, and the workers' grace
covers their stop.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from prefixq.cli.main import build_parser
from prefixq.core.settings import Settings
from prefixq.integrations.serve_metrics import LABEL, SERIES
from prefixq.worker.lifecycle import stop_bound_s

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy/k8s"
#: the Kubernetes releases the manifests are validated for: the oldest still in common managed
#: offerings when this was written, and the newest the pinned kubernetes-validate knows
K8S_VERSIONS = ("1.30.0", "1.37.0")
KEDA_SCHEMA = ROOT / "tests/data/keda-scaledobject-v2.20.2.schema.yaml"
#: seconds a worker's engine and process get to exit after its stop is done
ENGINE_EXIT_S = 30

Doc = dict[str, Any]


def render(folder: Path) -> list[Doc]:
    """The objects a Kustomize folder builds: its ``resources`` (files, or folders built the same
    way) and ``components``, in order. Any other field fails: this loader does not apply it."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "resources", "components"}
    assert not unknown, f"{folder}: the test's loader does not apply {sorted(unknown)}"
    docs: list[Doc] = []
    for entry in [*k.get("resources", []), *k.get("components", [])]:
        path = folder / entry
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def ident(d: Doc) -> tuple[str, str]:
    return d["kind"], d["metadata"]["name"]


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], Doc]:
    docs = render(K8S)
    ids = [ident(d) for d in docs]
    assert len(ids) == len(set(ids)), f"an object is defined twice: {ids}"
    return dict(zip(ids, docs, strict=True))


def container(objects: dict[tuple[str, str], Doc], kind: str, name: str) -> Doc:
    (c,) = objects[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return c


def env_of(objects: dict[tuple[str, str], Doc], c: Doc) -> dict[str, str]:
    """The environment a container gets: its ConfigMaps (envFrom, in order), then ``env``
    (a value from a Secret is a placeholder)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            env |= objects[("ConfigMap", src["configMapRef"]["name"])]["data"]
    for e in c.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else f"<from {e['valueFrom']}>"
    return env


def parse(argv: list[str]) -> argparse.Namespace:
    """``prefixq ARGV`` through prefixq's own parser; a usage error fails the test."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`prefixq {' '.join(argv)}` does not parse (exit {e.code})")


def test_the_tree_renders_what_kubectl_kustomize_renders(
    objects: dict[tuple[str, str], Doc],
) -> None:
    """Both components and the base are there; where kubectl is installed, `kubectl kustomize`
    builds the same objects as the loader."""
    assert set(objects) == {
        ("ConfigMap", "prefixq-config"),
        ("Deployment", "prefixq-worker"),
        ("PersistentVolumeClaim", "prefixq-models"),
        ("Deployment", "prefixq-serve"),
        ("Service", "prefixq-serve"),
        ("PersistentVolumeClaim", "prefixq-files"),
        ("StatefulSet", "redis"),
        ("Service", "redis"),
        ("ScaledObject", "prefixq-worker"),
    }
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the loader's rendering is not cross-checked")
    p = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, check=False
    )
    assert p.returncode == 0, p.stderr
    built = {ident(d): d for d in yaml.safe_load_all(p.stdout) if d}

    def canon(x: dict[tuple[str, str], Doc]) -> dict[str, str]:
        return {f"{k}/{n}": json.dumps(d, sort_keys=True) for (k, n), d in x.items()}

    assert canon(built) == canon(objects)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_kubernetes_object_validates_strictly(
    objects: dict[tuple[str, str], Doc], version: str
) -> None:
    """Each object but KEDA's validates against the API schemas of that Kubernetes release,
    unknown fields refused."""
    for key, doc in objects.items():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{key} is not a valid object of Kubernetes {version}: {e.message}")


def _closed(schema: Any) -> Any:
    """The CRD schema with unknown fields refused wherever it lists properties (the API server
    prunes them silently, hiding a misspelt field), as kubernetes-validate's strict mode does."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    return schema


def test_the_scaled_object_validates_against_kedas_crd_schema(
    objects: dict[tuple[str, str], Doc],
) -> None:
    """The ScaledObject fits KEDA's CRD schema (unknown fields refused); the same schema refuses
    a misspelt field, so the check can fail."""
    schema = _closed(yaml.safe_load(KEDA_SCHEMA.read_text()))
    so = objects[("ScaledObject", "prefixq-worker")]
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    jsonschema.validate(so, schema)
    typo = json.loads(json.dumps(so))
    typo["spec"]["minReplicas"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, schema)


def test_the_scaled_object_scales_the_workers_on_a_gauge_serve_exports(
    objects: dict[tuple[str, str], Doc],
) -> None:
    """Its target is the workers' Deployment; its Prometheus query reads a series `prefixq
    serve` exports, for the namespace the pods use, with `max` over the replicas; it may scale to
    zero, and wakes on any request."""
    spec = objects[("ScaledObject", "prefixq-worker")]["spec"]
    assert spec["scaleTargetRef"]["name"] == "prefixq-worker"
    assert ("Deployment", "prefixq-worker") in objects
    assert spec["minReplicaCount"] == 0 < spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    m = re.fullmatch(r"max\((\w+)\{(\w+)=\"([^\"]+)\"\}\)", trigger["metadata"]["query"])
    assert m is not None, trigger["metadata"]["query"]
    name, label, namespace = m.groups()
    assert name == "prefixq_outstanding_requests" and name in dict(SERIES)
    assert label == LABEL
    assert namespace == objects[("ConfigMap", "prefixq-config")]["data"]["PREFIXQ_NAMESPACE"]
    assert float(trigger["metadata"]["activationThreshold"]) == 0
    assert float(trigger["metadata"]["threshold"]) > 0


def test_every_setting_named_is_a_setting_and_the_values_are_valid(
    objects: dict[tuple[str, str], Doc],
) -> None:
    """Every PREFIXQ_* (and REDIS_URL) the ConfigMap or a container sets is the environment name
    of a Settings field, and each container's environment makes valid Settings."""
    names = {Settings().env_name(f.name) for f in dataclasses.fields(Settings)}
    config = objects[("ConfigMap", "prefixq-config")]["data"]
    assert set(config) <= names, set(config) - names
    for kind, name in (("Deployment", "prefixq-worker"), ("Deployment", "prefixq-serve")):
        env = env_of(objects, container(objects, kind, name))
        ours = {k for k in env if k.startswith("PREFIXQ_") or k == "REDIS_URL"}
        assert ours <= names, f"{name}: not settings: {ours - names}"
        plain = {k: v for k, v in env.items() if not v.startswith("<from ")}
        Settings.from_env(plain)  # raises ConfigError on a bad value


def test_redis_url_reaches_the_redis_service_and_a_secret_may_override_it(
    objects: dict[tuple[str, str], Doc],
) -> None:
    """REDIS_URL names the Redis Service and its port; the Redis is AOF everysec, noeviction;
    every prefixq container reads an optional prefixq-redis Secret after the ConfigMap, so that
    Secret's REDIS_URL wins (an external Redis), and the same optional webhooks Secret (every
    process that delivers webhooks needs the same setting)."""
    url = urlsplit(objects[("ConfigMap", "prefixq-config")]["data"]["REDIS_URL"])
    svc = objects[("Service", url.hostname or "")]
    assert [p["port"] for p in svc["spec"]["ports"]] == [url.port]
    redis = container(objects, "StatefulSet", "redis")
    args = " ".join(redis["args"])
    for flag in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction"):
        assert flag in args
    assert (
        svc["spec"]["selector"]
        == objects[("StatefulSet", "redis")]["spec"]["selector"]["matchLabels"]
    )
    for name in ("prefixq-worker", "prefixq-serve"):
        c = container(objects, "Deployment", name)
        hooks = {e["name"]: e for e in c["env"]}["PREFIXQ_WEBHOOKS"]["valueFrom"]["secretKeyRef"]
        assert hooks == {"name": "prefixq-webhooks", "key": "webhooks", "optional": True}
        sources = c["envFrom"]
        assert sources == [
            {"configMapRef": {"name": "prefixq-config"}},
            {"secretRef": {"name": "prefixq-redis", "optional": True}},
        ]


def test_workers_join_with_one_gpu_probe_with_check_and_stop_within_their_grace(
    objects: dict[tuple[str, str], Doc],
) -> None:
    """The worker pod runs `prefixq worker --join --hand-over` (the image's entrypoint is
    `prefixq`) with one GPU; its probes are `prefixq check --local` (startup, readiness) and
    `--local --alive` (liveness); its metrics port is the one its environment sets and its
    annotations name; terminationGracePeriodSeconds covers the worker's longest stop with
    hand-over (stop_bound_s) plus the engine's exit."""
    assert re.search(r'^ENTRYPOINT \["prefixq"\]$', (ROOT / "Dockerfile").read_text(), re.M)
    dep = objects[("Deployment", "prefixq-worker")]
    pod = dep["spec"]["template"]
    c = container(objects, "Deployment", "prefixq-worker")
    args = parse(c["args"])
    assert args.command == "worker" and args.join and args.hand_over and args.shard is None
    assert args.gpu == "0"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    probes = {k: parse(c[k]["exec"]["command"][1:]) for k in ("startupProbe", "readinessProbe")}
    for kind, p in probes.items():
        assert c[kind]["exec"]["command"][0] == "prefixq"
        assert p.command == "check" and p.local and not p.alive and p.shard is None, kind
    live = parse(c["livenessProbe"]["exec"]["command"][1:])
    assert live.command == "check" and live.local and live.alive
    env = env_of(objects, c)
    settings = Settings.from_env({k: v for k, v in env.items() if not v.startswith("<from ")})
    (port,) = c["ports"]
    assert port["containerPort"] == settings.metrics_port > 0
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(settings.metrics_port)
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= stop_bound_s(settings, hand_over=True) + ENGINE_EXIT_S
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no spare GPU assumed
    # every volume mounted is one the pod has, and its claims exist
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert {m["name"] for m in c["volumeMounts"]} <= set(volumes)
    for v in volumes.values():
        if "persistentVolumeClaim" in v:
            claim = v["persistentVolumeClaim"]["claimName"]
            assert ("PersistentVolumeClaim", claim) in objects
    assert "/models/" in args.model


def test_serve_listens_where_its_service_and_probes_point_with_keys_and_shared_files(
    objects: dict[tuple[str, str], Doc],
) -> None:
    """The serve pods run `prefixq serve --host 0.0.0.0` (so API keys from a Secret), on the port
    the Service, probes and scrape annotations use, at least two replicas, files on one
    ReadWriteMany claim mounted at PREFIXQ_FILES_DIR."""
    dep = objects[("Deployment", "prefixq-serve")]
    pod = dep["spec"]["template"]
    c = container(objects, "Deployment", "prefixq-serve")
    args = parse(c["args"])
    assert args.command == "serve" and args.host == "0.0.0.0"
    (port,) = c["ports"]
    assert port["containerPort"] == args.port == build_parser().parse_args(["serve"]).port
    svc = objects[("Service", "prefixq-serve")]
    (sp,) = svc["spec"]["ports"]
    assert sp["targetPort"] == port["name"] and sp["port"] == args.port
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": port["name"]}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.port)
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    env = {e["name"]: e for e in c["env"]}
    assert env["PREFIXQ_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "prefixq-api-keys"
    assert dep["spec"]["replicas"] >= 2
    (mount,) = c["volumeMounts"]
    assert mount["mountPath"] == env["PREFIXQ_FILES_DIR"]["value"]
    (vol,) = pod["spec"]["volumes"]
    claim = objects[("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
