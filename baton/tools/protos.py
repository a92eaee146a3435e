"""Generate the Python gRPC stubs of proto/baton/v1/baton.proto into deployments/grpc_gen/.

    python -m baton.tools.protos [--out DIR]

Run by the set-up (scripts/setup.sh); the output is gitignored, never committed. protoc names
modules after the proto's path (`baton/v1/baton_pb2.py`, imported as `baton.v1` — which would
shadow the `baton` package), so the stubs are written flat into one package and the generated
service module's import of its messages is rewritten to that package. Idempotent: files whose
content is unchanged are not rewritten.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from baton.paths import REPO_ROOT

PROTO_ROOT = REPO_ROOT / "proto"
PROTO = "baton/v1/baton.proto"
OUT = REPO_ROOT / "deployments" / "grpc_gen"
PACKAGE = "deployments.grpc_gen"
_GENERATED_IMPORT = "from baton.v1 import baton_pb2 as baton_dot_v1_dot_baton__pb2"
# the module name the message classes carry (their __module__): protoc writes the proto's path,
# which is not importable here; Ray pickles a class whose module cannot be imported by value,
# and a upb message class cannot be (Serve hands every gRPC request to the ingress through Ray)
_GENERATED_MODULE = "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'baton.v1.baton_pb2', _globals)"


def generate(out: Path = OUT, package: str = PACKAGE) -> list[Path]:
    """Write baton_pb2.py, baton_pb2.pyi, baton_pb2_grpc.py and __init__.py into `out`; the
    paths written. Raises RuntimeError when protoc fails."""
    from grpc_tools import protoc  # set-up dependency (grpcio-tools)

    with tempfile.TemporaryDirectory() as tmp:
        include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                          f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO_ROOT / PROTO)])
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc}) on {PROTO_ROOT / PROTO}")
        gen = Path(tmp) / "baton" / "v1"
        files = {p.name: p.read_text() for p in gen.iterdir() if p.suffix in (".py", ".pyi")}
    service = files["baton_pb2_grpc.py"]
    if _GENERATED_IMPORT not in service:
        raise RuntimeError("the generated service module no longer imports its messages as expected: update baton/tools/protos.py")
    files["baton_pb2_grpc.py"] = service.replace(_GENERATED_IMPORT, f"from {package} import baton_pb2 as baton_dot_v1_dot_baton__pb2")
    messages = files["baton_pb2.py"]
    if _GENERATED_MODULE not in messages:
        raise RuntimeError("the generated message module no longer names itself as expected: update baton/tools/protos.py")
    files["baton_pb2.py"] = messages.replace(_GENERATED_MODULE, _GENERATED_MODULE.replace("'baton.v1.baton_pb2'", f"'{package}.baton_pb2'"))
    files["__init__.py"] = f'"""Generated from proto/{PROTO} by baton/tools/protos.py (set-up): do not edit, not committed."""\n'
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in sorted(files.items()):
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    written = generate(args.out)
    print(f"[protos] {len(written)} file(s) written to {args.out}" if written else f"[protos] {args.out} is up to date", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
