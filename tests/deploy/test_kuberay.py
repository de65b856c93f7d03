"""``deploy/kuberay/``, checked without a cluster (no Kubernetes API server can be installed here).

- Core objects (Deployment, Service, PodDisruptionBudget, ConfigMap, PVC, Namespace) against Kubernetes
  1.33's own OpenAPI schemas, strictly (unknown fields refused), with ``kubernetes-validate``; so are the
  pod templates inside the RayCluster, as PodTemplates.
- The custom resources (RayCluster, ServiceMonitor, PrometheusRule) have no schema there: they are checked
  against schemas written here (``schemas/``: the fields and types of the CRDs that the manifests use) and
  by structure.
- Then what would break at run time though every object is valid: a worker group per fleet zone, pinned
  to that zone and labelled for placement; the control plane's config loads and points at the head's
  Ray Client port; every selector finds its pods; the ServiceMonitors find the replicas', the gateways'
  and the control plane's pages under the job names the Grafana dashboard filters on, and the
  PrometheusRule holds the recording rules ``controlplane up`` loads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from controlplane.api.process_metrics import STATE_PATH
from controlplane.config import load_config
from controlplane.fleet.backends.ray_thread import ZONE_LABEL
from controlplane.telemetry.prometheus_server import REPLICAS_JOB
from controlplane.telemetry.recording_rules import prometheus_rule, rule_file

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kuberay"
SCHEMAS = Path(__file__).parent / "schemas"
KUBERNETES_VERSION = "1.33.0"
CUSTOM = {"RayCluster": "raycluster.schema.json", "ServiceMonitor": "servicemonitor.schema.json",
          "PrometheusRule": "prometheusrule.schema.json"}
DASHBOARD = ROOT / "deploy" / "grafana" / "llmsre-fleet.json"
# The jobs `controlplane up`'s own Prometheus scrapes (app.py), which the dashboard's panels filter on.
JOBS = {REPLICAS_JOB, "gateway", "controlplane"}


def documents() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in sorted(MANIFESTS.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def named(kind: str, name: str) -> dict[str, Any]:
    return next(doc for doc in of_kind(kind) if doc["metadata"]["name"] == name)


def pod_templates() -> list[dict[str, Any]]:
    """Every pod template: the Deployments' and each RayCluster group's."""
    templates = [d["spec"]["template"] for d in of_kind("Deployment")]
    for cluster in of_kind("RayCluster"):
        templates.append(cluster["spec"]["headGroupSpec"]["template"])
        templates += [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    return templates


def selects(selector: dict[str, str], template: dict[str, Any]) -> bool:
    labels = template["metadata"].get("labels", {})
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize(("name", "doc"), [d for d in documents() if d[1]["kind"] not in CUSTOM],
                         ids=lambda x: x if isinstance(x, str) else f"{x['kind']}/{x['metadata']['name']}")
def test_each_core_object_is_valid_for_kubernetes_1_33(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validation_refuses_a_misspelt_field() -> None:
    deployment = json.loads(json.dumps(of_kind("Deployment")[0]))
    deployment["spec"]["replicaz"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    cluster = json.loads(json.dumps(of_kind("RayCluster")[0]))
    cluster["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 4  # KubeRay wants strings
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cluster, json.loads((SCHEMAS / CUSTOM["RayCluster"]).read_text()))


@pytest.mark.parametrize("kind", sorted(CUSTOM))
def test_each_custom_resource_matches_the_schema_written_for_it(kind: str) -> None:
    schema = json.loads((SCHEMAS / CUSTOM[kind]).read_text())
    assert of_kind(kind)
    for doc in of_kind(kind):
        jsonschema.validate(doc, schema)


def test_the_raycluster_pod_templates_are_valid_pod_templates() -> None:
    for template in pod_templates():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, KUBERNETES_VERSION, strict=True)


def fleet_config(tmp_path: Path) -> Any:
    config = tmp_path / "controlplane.toml"
    config.write_text(named("ConfigMap", "llmsre-controlplane")["data"]["controlplane.toml"])
    return load_config(config)


def test_one_worker_group_per_fleet_zone_pinned_to_it_and_labelled_for_placement(tmp_path: Path) -> None:
    fleet = fleet_config(tmp_path).fleet
    (cluster,) = of_kind("RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert sorted(groups) == sorted(fleet.zones)
    for zone, group in groups.items():
        assert group["rayStartParams"]["labels"] == f"{ZONE_LABEL}={zone}"
        affinity = group["template"]["spec"]["affinity"]["nodeAffinity"]
        terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In",
                                                "values": [zone]}]}]
        assert group["minReplicas"] >= 1  # a zone keeps a node for its replicas
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replica on the head


def test_the_control_plane_config_loads_and_reaches_the_heads_ray_client_port(tmp_path: Path) -> None:
    config = fleet_config(tmp_path)
    (cluster,) = of_kind("RayCluster")
    head = cluster["spec"]["headGroupSpec"]
    client_port = head["rayStartParams"]["ray-client-server-port"]
    name, namespace = cluster["metadata"]["name"], cluster["metadata"]["namespace"]
    assert config.fleet.backend == "ray"
    assert config.fleet.ray_address == f"ray://{name}-head-svc.{namespace}.svc:{client_port}"  # KubeRay's
    head_ports = head["template"]["spec"]["containers"][0]["ports"]
    assert {"containerPort": int(client_port), "name": "client"} in head_ports
    assert config.api.host == "0.0.0.0" and config.fleet.on_node_loss in ("stay", "spill")
    deployment = named("Deployment", "llmsre-controlplane")
    mount = deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "state", "mountPath": config.state_dir} in mount  # the store lives on the volume
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # never two writers of one store


def test_every_service_and_budget_selects_pods_that_exist() -> None:
    templates = pod_templates()
    for service in of_kind("Service"):
        matching = [t for t in templates if selects(service["spec"]["selector"], t)]
        assert matching, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            for t in matching:
                ports = [p for c in t["spec"]["containers"] for p in c.get("ports", [])]
                assert any(target in (p["containerPort"], p.get("name")) for p in ports), \
                    f"Service {service['metadata']['name']}: no container port {target}"
    for budget in of_kind("PodDisruptionBudget"):
        assert any(selects(budget["spec"]["selector"]["matchLabels"], t) for t in templates), \
            f"PodDisruptionBudget {budget['metadata']['name']} selects no pod"


def monitored(monitor: dict[str, Any]) -> dict[str, Any]:
    """The one Service a ServiceMonitor selects."""
    (service,) = [s for s in of_kind("Service") if
                  all(s["metadata"].get("labels", {}).get(k) == v
                      for k, v in monitor["spec"]["selector"]["matchLabels"].items())]
    return service


def test_the_service_monitor_scrapes_every_replica_port_of_the_replica_hosts() -> None:
    monitor = named("ServiceMonitor", "llmsre-replicas")
    service = monitored(monitor)
    assert service["spec"]["clusterIP"] == "None"
    named_ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == named_ports
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]


def test_the_service_monitors_name_their_jobs_as_the_dashboard_filters_them() -> None:
    jobs: dict[str, dict[str, Any]] = {}
    for monitor in of_kind("ServiceMonitor"):
        service = monitored(monitor)
        assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports, monitor["metadata"]["name"]
        # the Prometheus operator names the job after the Service's label that jobLabel names
        jobs[service["metadata"]["labels"][monitor["spec"]["jobLabel"]]] = monitor
    assert set(jobs) == JOBS
    filtered = set(re.findall(r'job=\\?"([^"\\]+)', DASHBOARD.read_text()))
    assert filtered and filtered <= JOBS


def test_the_replicas_up_series_carry_their_zone() -> None:
    for endpoint in named("ServiceMonitor", "llmsre-replicas")["spec"]["endpoints"]:
        assert endpoint["honorLabels"] is True  # the page names its replica: no discovery here knows it
        assert {"sourceLabels": ["__meta_kubernetes_pod_label_llmsre_zone"], "targetLabel": "zone"} \
            in endpoint["relabelings"]
    for cluster in of_kind("RayCluster"):
        for group in cluster["spec"]["workerGroupSpecs"]:
            assert group["template"]["metadata"]["labels"]["llmsre/zone"] == group["groupName"]


def test_the_control_planes_state_is_scraped_with_a_viewer_token_from_the_secret() -> None:
    (endpoint,) = named("ServiceMonitor", "llmsre-controlplane")["spec"]["endpoints"]
    assert endpoint["path"] == STATE_PATH
    assert endpoint["authorization"] == {"type": "Bearer",
                                         "credentials": {"name": "llmsre-secrets", "key": "metrics-token"}}
    assert "metrics-token=" in (MANIFESTS / "controlplane.yaml").read_text()  # how to create it


def test_the_prometheus_rule_holds_the_rules_controlplane_up_loads() -> None:
    text = (MANIFESTS / "recording-rules.yaml").read_text()
    regenerate = "regenerate: python -m controlplane.telemetry.recording_rules --kubernetes"
    assert text == prometheus_rule(), regenerate
    (rule,) = of_kind("PrometheusRule")
    assert rule["spec"] == yaml.safe_load(rule_file())


def test_the_gateways_watch_the_control_planes_service() -> None:
    command = named("Deployment", "llmsre-gateway")["spec"]["template"]["spec"]["containers"][0]["command"]
    url = command[command.index("--control-plane") + 1]
    api = named("Service", "llmsre-controlplane")
    port = next(p["port"] for p in api["spec"]["ports"] if p["name"] == "api")
    assert re.fullmatch(rf"http://{api['metadata']['name']}\.{api['metadata']['namespace']}\.svc:{port}", url)


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS.glob("*.yaml")
                                                        if p.name != "kustomization.yaml")
