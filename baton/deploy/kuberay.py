"""A KubeRay RayService manifest for a Serve config: `python -m baton.deploy.kuberay CONFIG [--image I] [--out F]`.

The manifest runs exactly the Serve config (its whole text is `spec.serveConfigV2`, so the two
cannot drift: tests/unit/test_deploy_manifests.py regenerates the shipped one and compares) on a
RayCluster with one worker group per GPU type the pools name:

    head         Serve's controller and proxies, the ingress and the directory (rayStartParams
                 num-gpus 0); the API keys from the Secret `baton-api-keys` (ingress.api_keys_env)
    <type> group one GPU per pod, `accelerator_type:<type>` set as a resource (Ray detects it on
                 bare nodes; in a pod the group states it), on nodes labelled
                 baton.io/accelerator=<type>, replicas from the pools on that type:
                 minReplicas = their min_replicas, maxReplicas = their max_replicas, replicas =
                 their initial (or min) replicas
Models come from a read-only volume at the config's `model_cache` (a PersistentVolumeClaim named
`baton-models`); nothing is pulled from a hub. KubeRay's own field names (ray.io/v1 RayService,
as its API reference documents them); requests and limits per pod from the pool's resources.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from deployments.config import AppConfig, PoolConfig, load_app_config

RAY_VERSION = "2.60.0"
DEFAULT_IMAGE = "baton:latest"  # an image with the project installed (pip install -e ".[gpu]")
SERVE_PORT = 8000


def _pools(cfg: AppConfig) -> list[PoolConfig]:
    return [p for p in (cfg.prefill, cfg.decode) if p is not None and p.resources.num_gpus > 0]


def _replicas(pool: PoolConfig) -> tuple[int, int, int]:
    """(min, initial, max) engine replicas of a pool."""
    a = pool.autoscaling
    if a is None:
        return pool.num_replicas, pool.num_replicas, pool.num_replicas
    return a.min_replicas, a.initial_replicas if a.initial_replicas is not None else a.min_replicas, a.max_replicas


def _container(name: str, image: str, cpus: float, gpus: int, model_cache: str, env: list[dict[str, Any]]) -> dict[str, Any]:
    """Memory: 8 GiB per CPU, at least 32 GiB on a GPU pod (the weights pass through host memory as they load)."""
    memory = max(32 if gpus else 8, int(cpus) * 8)
    quantity = {"cpu": f"{cpus:g}", "memory": f"{memory}Gi", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    out: dict[str, Any] = {"name": name, "image": image, "resources": {"requests": quantity, "limits": dict(quantity)}, "env": env,
                           "volumeMounts": [{"name": "models", "mountPath": model_cache, "readOnly": True}]}
    if not gpus:
        out["ports"] = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": SERVE_PORT, "name": "serve"}]
    return out


def rayservice(serve_config_text: str, *, name: str = "baton", image: str = DEFAULT_IMAGE) -> dict[str, Any]:
    doc = yaml.safe_load(serve_config_text)
    apps = doc["applications"]
    cfgs = [load_app_config(a["args"]) for a in apps]  # a config that does not validate is refused here
    model_cache = apps[0]["args"].get("model_cache", "/mnt/models")
    env = []
    keys_env = cfgs[0].ingress.api_keys_env
    if keys_env:
        env.append({"name": keys_env, "valueFrom": {"secretKeyRef": {"name": "baton-api-keys", "key": "keys"}}})
    volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": "baton-models", "readOnly": True}}]
    groups: dict[str, list[PoolConfig]] = {}
    for cfg in cfgs:
        for pool in _pools(cfg):
            groups.setdefault(pool.resources.accelerator_type or "gpu", []).append(pool)
    workers = []
    for accel, pools in groups.items():
        per_pod_cpus = max(p.resources.num_cpus for p in pools)
        mins, inits, maxs = zip(*(_replicas(p) for p in pools), strict=True)
        resources = {f"accelerator_type:{accel}": 1} if accel != "gpu" else {}
        workers.append({
            "groupName": f"gpu-{accel.lower()}",
            "replicas": sum(inits), "minReplicas": sum(mins), "maxReplicas": sum(maxs),
            # quoted for the shell, as KubeRay passes it on to `ray start --resources=...`
            "rayStartParams": {"num-gpus": "1", **({"resources": json.dumps(json.dumps(resources))} if resources else {})},
            "template": {"spec": {"containers": [_container("ray-worker", image, per_pod_cpus, 1, model_cache, env)], "volumes": volumes,
                                  "nodeSelector": {"baton.io/accelerator": accel}}},
        })
    head_cpus = sum(c.ingress.num_cpus * c.ingress.num_replicas for c in cfgs) + 2  # + controller, proxy, directory
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "serveConfigV2": serve_config_text,
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "headGroupSpec": {"rayStartParams": {"num-gpus": "0", "dashboard-host": "0.0.0.0"},
                                  "template": {"spec": {"containers": [_container("ray-head", image, head_cpus, 0, model_cache, env)],
                                                        "volumes": volumes}}},
                "workerGroupSpecs": workers,
            },
        },
    }


HEADER = ("# Generated by `python -m baton.deploy.kuberay {src}` from {src} (do not edit: regenerate).\n"
          "# kubectl apply -f this file, after a Secret `baton-api-keys` (key `keys`: BATON_API_KEYS's value), a\n"
          "# PersistentVolumeClaim `baton-models` holding the HF model folders, and GPU nodes labelled\n"
          "# baton.io/accelerator=<type> (H100, L40S, ...). Tested by tests/unit/test_deploy_manifests.py.\n")


class _Dumper(yaml.SafeDumper):
    """No anchors and aliases; multi-line strings (serveConfigV2) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _text)


def render(src: Path, image: str = DEFAULT_IMAGE) -> str:
    manifest = rayservice(src.read_text(), image=image)
    return HEADER.format(src=src.as_posix()) + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("--image", default=DEFAULT_IMAGE)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    text = render(a.config, a.image)
    if a.out is None:
        print(text, end="")
    else:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
