"""deploy/: the Kubernetes manifests and KServe examples, checked offline (no cluster, no network).

* Core kinds (Deployment, Service, HorizontalPodAutoscaler, ...) against Kubernetes' own OpenAPI schemas, which
  kubernetes-validate ships, strictly (an unknown or misspelt field fails), for the oldest and the newest
  Kubernetes the manifests claim. The overlays (models-pvc, models-pvc-single-node) are checked as kustomize
  builds them (their patches merged here by name, as a strategic merge does for these lists).
* Custom resources (InferenceService, ServingRuntime, ScaledObject, ServiceMonitor, IngressRoute) are in no such
  schema: each is checked against a small closed schema below (our reading of the fields we use, not the CRD),
  whose embedded Kubernetes types (containers, volumes, security contexts, HPA behavior) are Kubernetes' own.
* Consistency with the server: probe paths are routes the app serves without a key, the container port is the
  one the server listens on, every APPLIANCE_* variable and --flag is a serve flag (parsed by the real parser),
  the metrics scaled on are ones /metrics exports, threads and the KV budget fit the pod's resources.
"""

from __future__ import annotations

import importlib.resources
import inspect
import json
import os
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from appliance import __version__, cli, options
from appliance.http.client import EngineClient
from appliance.openai_api.app import OPEN_PATHS, create_app
from appliance.server.metrics import ServerMetrics
from appliance.settings import ServeSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())  # the oldest still-supported k3s line, the newest
CORE_API_VERSIONS = {"v1", "apps/v1", "autoscaling/v2", "policy/v1", "networking.k8s.io/v1"}
HELM_VALUES = {"kubernetes/autoscaling/prometheus-adapter-values.yaml"}  # not a Kubernetes object
OVERLAYS = ("kubernetes/models-pvc", "kubernetes/models-pvc-single-node")  # checked as built
# `appliance serve` with the default model and 2 workers, before the KV pool fills: VmRSS of its processes
# (744 MB engine + ~60 MB gunicorn; docs/serving.md "Memory" has the breakdown).
RESIDENT_BYTES = 800 << 20


def documents() -> dict[str, list[dict]]:
    return {
        str(p.relative_to(DEPLOY)): [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
        for p in sorted(DEPLOY.rglob("*.yaml"))
    }


DOCS = documents()


def doc(path: str, kind: str | None = None) -> dict:
    return next(d for d in DOCS[path] if kind is None or d.get("kind") == kind)


def merge(base, patch):
    """A strategic merge patch for what the overlay patches: maps recursively, lists of named items by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: merge(base.get(k), v) for k, v in patch.items()}}
    named = isinstance(base, list) and isinstance(patch, list)
    if named and all(isinstance(i, dict) and "name" in i for i in base + patch):
        out = {i["name"]: i for i in base}
        for item in patch:
            out[item["name"]] = merge(out.get(item["name"]), item)
        return list(out.values())
    return patch


def built(overlay: str) -> list[dict]:
    """`kustomize build` of an overlay, for what ours use: resources (files or directories) and patches."""
    k = doc(f"{overlay}/kustomization.yaml")
    out: list[dict] = []
    for res in k["resources"]:
        path = (DEPLOY / overlay / res).resolve().relative_to(DEPLOY)
        out += built(str(path)) if (DEPLOY / path).is_dir() else DOCS[str(path)]
    for patch in k.get("patches", []):
        p = doc(str((DEPLOY / overlay / patch["path"]).resolve().relative_to(DEPLOY)))
        out = [
            merge(d, p) if (d["kind"], d["metadata"]["name"]) == (p["kind"], p["metadata"]["name"]) else d for d in out
        ]
    return out


# ---- custom resources: closed structural schemas; Kubernetes' own definitions for what they embed
def k8s(name: str) -> dict:
    return {"$ref": f"/api/_definitions.json#/$defs/io.k8s.{name}"}


def obj(required: tuple[str, ...] = (), **props) -> dict:
    return {"type": "object", "required": list(required), "properties": props, "additionalProperties": False}


def arr(items: dict, min_items: int = 1) -> dict:
    return {"type": "array", "items": items, "minItems": min_items}


STR, INT, BOOL = {"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "boolean"}
POD_PARTS = dict(containers=arr(k8s("api.core.v1.Container")), volumes=arr(k8s("api.core.v1.Volume"), 0))
TARGET = obj(("type",), type={"enum": ["Utilization", "Value", "AverageValue"]}, value=STR, averageValue=STR)
PREDICTOR = obj(
    (),
    minReplicas=INT,
    maxReplicas=INT,
    model=obj(("modelFormat",), modelFormat=obj(("name",), name=STR, version=STR), runtime=STR, storageUri=STR),
    securityContext=k8s("api.core.v1.PodSecurityContext"),
    terminationGracePeriodSeconds=INT,
    enableServiceLinks=BOOL,
    autoScaling=obj(
        ("metrics",),
        metrics=arr(
            obj(
                ("type", "external"),
                type={"const": "External"},
                external=obj(
                    ("metric", "target"),
                    metric=obj(("backend", "serverAddress", "query"), backend=STR, serverAddress=STR, query=STR),
                    target=TARGET,
                ),
            )
        ),
    ),
    **POD_PARTS,
)
PREDICTOR["oneOf"] = [{"required": ["model"]}, {"required": ["containers"]}]  # a runtime's model, or our own container
SPECS = {
    ("serving.kserve.io/v1beta1", "InferenceService"): obj(("predictor",), predictor=PREDICTOR),
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): obj(
        ("supportedModelFormats", "containers"),
        supportedModelFormats=arr(obj(("name",), name=STR, version=STR, autoSelect=BOOL)),
        multiModel=BOOL,
        **POD_PARTS,
    ),
    ("keda.sh/v1alpha1", "ScaledObject"): obj(
        ("scaleTargetRef", "triggers"),
        scaleTargetRef=obj(("name",), name=STR, kind=STR, apiVersion=STR),
        minReplicaCount=INT,
        maxReplicaCount=INT,
        pollingInterval=INT,
        advanced=obj(
            (),
            horizontalPodAutoscalerConfig=obj((), behavior=k8s("api.autoscaling.v2.HorizontalPodAutoscalerBehavior")),
        ),
        triggers=arr(
            obj(
                ("type", "metadata"),
                type={"const": "prometheus"},
                metadata=obj(("serverAddress", "query", "threshold"), serverAddress=STR, query=STR, threshold=STR),
            )
        ),
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): obj(
        ("selector", "endpoints"),
        selector=k8s("apimachinery.pkg.apis.meta.v1.LabelSelector"),
        endpoints=arr(
            obj(
                ("port",),
                port=STR,
                path=STR,
                interval={"type": "string", "pattern": r"^\d+[smh]$"},
                authorization=obj(
                    ("credentials",), type={"const": "Bearer"}, credentials=k8s("api.core.v1.SecretKeySelector")
                ),
            )
        ),
    ),
    ("traefik.io/v1alpha1", "IngressRoute"): obj(
        ("routes",),
        entryPoints=arr(STR),
        routes=arr(
            obj(
                ("match", "kind", "services"),
                match=STR,
                kind={"const": "Rule"},
                services=arr(
                    obj(
                        ("name", "port"),
                        name=STR,
                        port={"type": ["string", "integer"]},
                        sticky=obj(
                            ("cookie",),
                            cookie=obj(
                                ("name",),
                                name=STR,
                                httpOnly=BOOL,
                                secure=BOOL,
                                sameSite={"enum": ["none", "lax", "strict"]},
                            ),
                        ),
                    )
                ),
            )
        ),
        tls=obj((), secretName=STR, certResolver=STR),
    ),
}


def custom_validator(api_version: str, kind: str) -> jsonschema.Validator:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://kubernetes.io/api/appliance-custom-resources.json",
        **obj(
            ("apiVersion", "kind", "metadata", "spec"),
            apiVersion={"const": api_version},
            kind={"const": kind},
            metadata=k8s("apimachinery.pkg.apis.meta.v1.ObjectMeta"),
            spec=SPECS[(api_version, kind)],
        ),
    }
    version = K8S_VERSIONS[0]
    folder = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}.0-local-strict"
    definitions = Resource.from_contents(json.loads((folder / "_definitions.json").read_text()))
    registry = Registry().with_resource("https://kubernetes.io/api/_definitions.json", definitions)
    return jsonschema.Draft202012Validator(schema, registry=registry)


def test_every_document_is_checked_against_a_schema():
    kinds = {"Kustomization"}
    for path, docs in DOCS.items():
        for d in docs:
            if path in HELM_VALUES or d["kind"] in kinds:
                continue
            if (d["apiVersion"], d["kind"]) in SPECS:
                custom_validator(d["apiVersion"], d["kind"]).validate(d)
            elif path.endswith("-patch.yaml"):
                continue  # a partial object: checked merged, below
            else:
                assert d["apiVersion"] in CORE_API_VERSIONS, f"{path}: {d['kind']} has no schema here"
                for version in K8S_VERSIONS:
                    kubernetes_validate.validate(d, version, strict=True)
    patches = {p for o in OVERLAYS for p in (f"{o}/{x['path']}" for x in doc(f"{o}/kustomization.yaml")["patches"])}
    assert patches == {path for path in DOCS if path.endswith("-patch.yaml")}  # every patch is in an overlay
    for overlay in OVERLAYS:
        for d in built(overlay):
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(d, version, strict=True)


def test_schemas_reject_what_a_cluster_would():
    deployment = doc("kubernetes/base/deployment.yaml")
    bad = merge(
        deployment, {"spec": {"template": {"spec": {"containers": [{"name": "appliance", "startupprobe": {}}]}}}}
    )
    with pytest.raises(kubernetes_validate.ValidationError, match="startupprobe"):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    runtime = doc("kserve/servingruntime.yaml")
    bad = merge(runtime, {"spec": {"containers": [{"name": "kserve-container", "ports": [{"containerPort": "8080"}]}]}})
    with pytest.raises(jsonschema.ValidationError):
        custom_validator(runtime["apiVersion"], runtime["kind"]).validate(bad)


def test_kustomizations_list_their_files():
    base = doc("kubernetes/base/kustomization.yaml")
    files = {p.name for p in (DEPLOY / "kubernetes/base").glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(base["resources"]) == sorted(files)
    for overlay in OVERLAYS:
        kinds = {d["kind"] for d in built(overlay)}
        assert kinds == {d["kind"] for d in built("kubernetes/base")} | {"PersistentVolumeClaim"}


def test_the_models_claim_fits_its_storage():
    """models-pvc shares the models across nodes (ReadOnlyMany: NFS, Longhorn); k3s's default local-path
    provisioner refuses that mode (the claim would stay Pending), so the single-node overlay asks ReadWriteOnce.
    Either way the pods mount it read-only."""
    claims = {o: next(d for d in built(o) if d["kind"] == "PersistentVolumeClaim") for o in OVERLAYS}
    modes = {o.rsplit("/", 1)[1]: c["spec"]["accessModes"] for o, c in claims.items()}
    assert modes == {"models-pvc": ["ReadOnlyMany"], "models-pvc-single-node": ["ReadWriteOnce"]}
    for overlay in OVERLAYS:
        claim = claims[overlay]
        assert claim["spec"]["resources"] == claims[OVERLAYS[0]]["spec"]["resources"]  # only the mode changed
        pod = next(d for d in built(overlay) if d["kind"] == "Deployment")["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}


# ---- consistency with the server
def pods() -> dict[str, dict]:
    """Each pod spec the manifests make (containers, volumes and pod fields), KServe's runtime with its predictor's."""
    isvc = doc("kserve/inferenceservice.yaml")["spec"]["predictor"]
    overlays = {o.rsplit("/", 1)[1]: next(d for d in built(o) if d["kind"] == "Deployment") for o in OVERLAYS}
    return {
        "base": doc("kubernetes/base/deployment.yaml")["spec"]["template"]["spec"],
        **{name: deployment["spec"]["template"]["spec"] for name, deployment in overlays.items()},
        "kserve runtime": {
            **doc("kserve/servingruntime.yaml")["spec"],
            **{k: v for k, v in isvc.items() if k != "model"},
        },
        "kserve custom": doc("kserve/inferenceservice-custom.yaml")["spec"]["predictor"],
    }


def container_env(container: dict) -> dict[str, str]:
    """Its environment: the ConfigMaps it takes whole, then its own `env`."""
    maps = {d["metadata"]["name"]: d["data"] for docs in DOCS.values() for d in docs if d.get("kind") == "ConfigMap"}
    env = {k: v for source in container.get("envFrom", []) for k, v in maps[source["configMapRef"]["name"]].items()}
    return env | {e["name"]: e["value"] for e in container.get("env", [])}


def size(text: str) -> int:
    """Bytes of a Kubernetes memory quantity (512Mi, 2Gi) or an nginx size (4m)."""
    m = re.fullmatch(r"(\d+)([KMG]i|[kmg])?", text)
    assert m, text
    return int(m[1]) << {None: 0, "Ki": 10, "k": 10, "Mi": 20, "m": 20, "Gi": 30, "g": 30}[m[2]]


@pytest.mark.parametrize("name", ["base", "models-pvc", "models-pvc-single-node", "kserve runtime", "kserve custom"])
def test_pod_matches_the_server(name, monkeypatch):
    pod = pods()[name]
    (container,) = [c for c in pod["containers"] if c["image"].startswith("appliance:")]
    assert container["image"] == f"appliance:{__version__}"  # the tag docs/deploy.md builds
    env = container_env(container)
    flags = {options.env_name(flag) for flag in options.SERVE_OPTIONS}
    assert set(env) <= flags | {"APPLIANCE_DATA_DIR"}, set(env) - flags
    for var in [v for v in os.environ if v.startswith("APPLIANCE_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    args = container.get("args", ["serve"])  # the image's CMD is `serve`; args replace it
    assert args[0] == "serve"
    ns = cli.build_parser().parse_args(args)  # unknown flags and unparsable values fail here
    # the port: the container's, its probes', served by the app without a key
    ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
    assert list(ports.values()) == [ns.port]
    settings = ServeSettings(model_dir="m", served_model_name="m", model_created=0)
    routes = {r.rule for r in create_app(settings, EngineClient("/nonexistent", b"k")).url_map.iter_rules()}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in routes and get["path"] in OPEN_PATHS
        assert ports.get(get["port"], get["port"]) == ns.port
    # locked down, with somewhere to write
    security = {**pod.get("securityContext", {}), **container["securityContext"]}
    image_user = re.search(r"^USER (\d+)", (DEPLOY.parent / "Dockerfile").read_text(), re.M)
    assert security["runAsNonRoot"] and image_user and security["runAsUser"] == int(image_user[1])
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"] and security["seccompProfile"]["type"] == "RuntimeDefault"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: (m, volumes[m["name"]]) for m in container["volumeMounts"]}

    def mount_of(path: str) -> tuple[dict, dict]:
        return next(mounts[m] for m in sorted(mounts, key=len, reverse=True) if path.startswith(m.rstrip("/") + "/"))

    assert "emptyDir" in mounts["/tmp"][1]  # the runtime directory: engine socket, gunicorn's files
    assert "emptyDir" in mount_of(ns.cache_dir)[1] and not mount_of(ns.cache_dir)[0].get("readOnly")
    # the state dir (Responses store, pulls, KV disk tier) on a writable volume of its own (the data dir is the
    # image's, read-only), the tier's budget within the volume's limit with room for the store
    state_mount, state_volume = mount_of(ns.state_dir + "/responses.sqlite3")
    assert state_mount["mountPath"] == ns.state_dir and not state_mount.get("readOnly")
    assert ns.kv_disk_dir.startswith(ns.state_dir + "/")
    assert ns.kv_disk_bytes < size(state_volume["emptyDir"]["sizeLimit"])
    keys_mount, keys_volume = mount_of(ns.api_key_file)
    assert keys_mount["readOnly"] and keys_volume["secret"]["secretName"] == "appliance-api-keys"
    # the server refuses a key file every user may read (appliance/auth.py): kubelet makes the Secret's
    # files root:<fsGroup> with defaultMode, so the pod's group reads it and others do not
    assert keys_volume["secret"]["defaultMode"] & 0o007 == 0 and security["fsGroup"] == security["runAsUser"]
    if ns.model != "default":
        assert ns.model.startswith("/mnt/models") or mount_of(ns.model)[0]["readOnly"]
    # shutdown: the preStop pause and --graceful-timeout fit in the grace period; no injected APPLIANCE_PORT
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pause + ns.graceful_timeout
    assert pod["enableServiceLinks"] is False
    # sized for the pod: threads = CPUs, the KV budget + what the server holds besides fits the memory limit
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert ns.num_threads == int(limits["cpu"]) == int(requests["cpu"])
    kind, kv_bytes = options.parse_kv_cache_size(ns.kv_cache_size)
    assert kind == "bytes" and RESIDENT_BYTES < size(requests["memory"])
    assert RESIDENT_BYTES + kv_bytes <= size(limits["memory"])


def exported_gauges() -> set[str]:
    metrics = ServerMetrics()
    models = "models" in inspect.signature(metrics.render).parameters  # one model or several (label `model`)
    text = metrics.render({"m": (True, {})}) if models else metrics.render(True, {})
    return set(re.findall(r"^# TYPE (\S+) gauge$", text, re.M))


def test_autoscaling_reads_metrics_the_server_exports():
    gauges = exported_gauges()
    hpa = doc("kubernetes/base/hpa.yaml")
    deployment = doc("kubernetes/base/deployment.yaml")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]}
    assert set(targets) == {"appliance_queue_depth", "appliance_running_sequences"} and set(targets) <= gauges
    max_num_seqs = options.SERVE_OPTIONS["max-num-seqs"].default
    assert 0 < int(targets["appliance_running_sequences"]) < max_num_seqs
    # prometheus-adapter serves exactly the HPA's metrics, under the same names
    (rule,) = doc("kubernetes/autoscaling/prometheus-adapter-values.yaml")["rules"]["custom"]
    series = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"])[1]
    served = {
        re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), g)
        for g in gauges
        if re.fullmatch(series, g)
    }
    assert served == set(targets)
    # KEDA and KServe: the same load (running + queued) over the same per-pod target
    scaled = doc("kubernetes/autoscaling/keda-scaledobject.yaml")
    isvc_metric = doc("kserve/inferenceservice.yaml")["spec"]["predictor"]["autoScaling"]["metrics"][0]["external"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    for query, threshold in (
        (scaled["spec"]["triggers"][0]["metadata"]["query"], scaled["spec"]["triggers"][0]["metadata"]["threshold"]),
        (isvc_metric["metric"]["query"], isvc_metric["target"]["averageValue"]),
    ):
        assert set(re.findall(r"appliance_\w+", query)) == set(targets) and 'model=""' in query
        assert threshold == targets["appliance_running_sequences"]


def test_service_monitor_and_ingresses_reach_the_service():
    service = doc("kubernetes/base/service.yaml")
    template = doc("kubernetes/base/deployment.yaml")["spec"]["template"]
    ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    assert service["spec"]["sessionAffinity"] == "ClientIP"  # the prefix cache is per pod
    names = {p["name"] for p in service["spec"]["ports"]}
    monitor = doc("kubernetes/autoscaling/servicemonitor.yaml")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in names and endpoint["path"] == "/metrics"
    assert "/metrics" in OPEN_PATHS or endpoint["authorization"]["credentials"]["name"] == "appliance-api-keys"
    route = doc("kubernetes/ingress/traefik.yaml")["spec"]["routes"][0]["services"][0]
    assert (route["name"], route["port"]) in {(service["metadata"]["name"], n) for n in names} and route["sticky"]
    nginx = doc("kubernetes/ingress/nginx.yaml")
    backend = nginx["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert (backend["name"], backend["port"]["name"]) in {(service["metadata"]["name"], n) for n in names}
    annotations = nginx["metadata"]["annotations"]
    assert "upstream-hash-by" in " ".join(annotations)
    body = annotations["nginx.ingress.kubernetes.io/proxy-body-size"]
    assert size(body) == options.SERVE_OPTIONS["max-body-bytes"].default
