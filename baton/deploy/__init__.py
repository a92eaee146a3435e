"""Deployment manifests generated from Serve configs (KubeRay)."""
