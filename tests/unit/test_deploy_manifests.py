"""The deployment manifests for the GPU configs: the Ray cluster launcher file against Ray's own
cluster-config schema (ray/autoscaler/ray-schema.json, through Ray's validate_config), and the
KubeRay RayService manifests against their generator (no drift from the Serve configs they run)
and against the RayService fields they use. KubeRay's CRD is not installable here (no package
carries it), so that last check is a schema of our own for the fields we emit, with the field
names of KubeRay's ray.io/v1 API reference and no others allowed."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from baton.deploy.kuberay import render
from deployments.config import load_app_config

CONFIGS = Path(__file__).resolve().parents[2] / "cluster_configs"
MANIFESTS = {CONFIGS / "kuberay" / "rayservice_gpu_example.yaml": CONFIGS / "gpu_example.yaml",
             CONFIGS / "kuberay" / "rayservice_gpu_hybrid_example.yaml": CONFIGS / "gpu_hybrid_example.yaml"}
LAUNCHER = CONFIGS / "launcher" / "aws_gpu.yaml"


def _launcher_check(cfg: dict[str, Any]) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cfg)))


def test_the_launcher_config_is_valid_for_ray_up() -> None:
    _launcher_check(yaml.safe_load(LAUNCHER.read_text()))


def test_the_launcher_check_refuses_a_misspelled_field() -> None:
    cfg = yaml.safe_load(LAUNCHER.read_text())
    cfg["available_node_types"]["decode_l40s"]["max_worker"] = 3
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        _launcher_check(cfg)


def _gpu_pools(source: Path) -> list[Any]:
    cfg = load_app_config(yaml.safe_load(source.read_text())["applications"][0]["args"])
    return [p for p in (cfg.prefill, cfg.decode) if p is not None and p.resources.num_gpus > 0]


def _max_replicas(pool: Any) -> int:
    return pool.autoscaling.max_replicas if pool.autoscaling is not None else pool.num_replicas


def test_the_launcher_has_gpus_for_every_pool_at_its_maximum() -> None:
    nodes = yaml.safe_load(LAUNCHER.read_text())["available_node_types"]
    gpus = {"H100": nodes["prefill_h100"]["max_workers"] * nodes["prefill_h100"]["resources"]["GPU"],
            "L40S": nodes["decode_l40s"]["max_workers"] * nodes["decode_l40s"]["resources"]["GPU"]}
    for pool in _gpu_pools(CONFIGS / "gpu_example.yaml"):
        assert gpus[pool.resources.accelerator_type] >= _max_replicas(pool) * pool.resources.num_gpus


@pytest.mark.parametrize("manifest", sorted(MANIFESTS), ids=lambda p: p.name)
def test_a_shipped_manifest_is_its_generators_output(manifest: Path) -> None:
    assert manifest.read_text() == render(MANIFESTS[manifest].relative_to(CONFIGS.parent)), \
        f"regenerate: python -m baton.deploy.kuberay {MANIFESTS[manifest].relative_to(CONFIGS.parent)} --out {manifest.relative_to(CONFIGS.parent)}"


def _strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_QUANTITY = {"type": "object", "additionalProperties": {"type": "string", "pattern": r"^[0-9.]+(Gi|Mi)?$"}}
_CONTAINER = _strict({"name": {"type": "string"}, "image": {"type": "string"},
                      "resources": _strict({"requests": _QUANTITY, "limits": _QUANTITY}, ("requests", "limits")),
                      "env": {"type": "array"}, "volumeMounts": {"type": "array"}, "ports": {"type": "array"}}, ("name", "image", "resources"))
_POD = _strict({"spec": _strict({"containers": {"type": "array", "items": _CONTAINER, "minItems": 1}, "volumes": {"type": "array"},
                                 "nodeSelector": _STR_MAP}, ("containers",))}, ("spec",))
RAYSERVICE_FIELDS = _strict({
    "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayService"}, "metadata": _strict({"name": {"type": "string"}}, ("name",)),
    "spec": _strict({
        "serveConfigV2": {"type": "string"},
        "rayClusterConfig": _strict({
            "rayVersion": {"type": "string"}, "enableInTreeAutoscaling": {"type": "boolean"},
            "headGroupSpec": _strict({"rayStartParams": _STR_MAP, "template": _POD}, ("rayStartParams", "template")),
            "workerGroupSpecs": {"type": "array", "items": _strict({
                "groupName": {"type": "string"}, "replicas": {"type": "integer"}, "minReplicas": {"type": "integer"},
                "maxReplicas": {"type": "integer"}, "rayStartParams": _STR_MAP, "template": _POD},
                ("groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"))},
        }, ("headGroupSpec",)),
    }, ("serveConfigV2", "rayClusterConfig")),
}, ("apiVersion", "kind", "metadata", "spec"))


@pytest.mark.parametrize("manifest", sorted(MANIFESTS), ids=lambda p: p.name)
def test_a_manifest_runs_its_serve_config_with_a_gpu_for_every_replica(manifest: Path) -> None:
    doc = yaml.safe_load(manifest.read_text().split("\n", 4)[-1])
    jsonschema.validate(doc, RAYSERVICE_FIELDS)
    spec = doc["spec"]
    assert spec["serveConfigV2"] == MANIFESTS[manifest].read_text()
    groups = {g["rayStartParams"].get("resources", ""): g for g in spec["rayClusterConfig"]["workerGroupSpecs"]}
    for pool in _gpu_pools(MANIFESTS[manifest]):
        accel = pool.resources.accelerator_type
        group = next(g for r, g in groups.items() if r and f"accelerator_type:{accel}" in json.loads(json.loads(r)))
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["maxReplicas"] >= _max_replicas(pool)
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == group["rayStartParams"]["num-gpus"] == "1"
        assert group["template"]["spec"]["nodeSelector"] == {"baton.io/accelerator": accel}
    assert spec["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"


def test_the_field_check_can_fail() -> None:
    doc = yaml.safe_load(sorted(MANIFESTS)[0].read_text())
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(doc, RAYSERVICE_FIELDS)
