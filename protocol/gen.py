"""Regenerate the protobuf/gRPC modules from the `.proto` files: `python -m bagel.protocol.gen`.

The generated files are committed (so an install needs no code generation), and
`tests/test_protocol_gen.py` regenerates into a temp dir and fails when they are stale.
grpc_tools emits flat imports (`import bagel_pb2`); we rewrite them to package imports.
Only a proto that declares a `service` gets a *_pb2_grpc.py (dataplane.proto has none: its
messages travel over libp2p streams, not gRPC).
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ("bagel.proto",)
# dataplane.proto is added by the worker's data plane when present.
OPTIONAL_PROTOS = ("dataplane.proto",)


def _protos() -> list[str]:
    return list(PROTOS) + [p for p in OPTIONAL_PROTOS if (PROTO_DIR / p).exists()]


def _has_service(proto: Path) -> bool:
    return re.search(r"^service\s", proto.read_text(), flags=re.MULTILINE) is not None


def generate(out_dir: Path) -> list[Path]:
    """Generate *_pb2.py and *_pb2.pyi for every proto into out_dir, and *_pb2_grpc.py for
    the protos that declare a service."""
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    out: list[Path] = []
    for proto in _protos():
        grpc = _has_service(PROTO_DIR / proto)
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            *([f"--grpc_python_out={out_dir}"] if grpc else []),
            str(PROTO_DIR / proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
        stem = proto.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", *(("_pb2_grpc.py",) if grpc else ())):
            path = out_dir / f"{stem}{suffix}"
            text = path.read_text()
            text = re.sub(r"^import (\w+_pb2) as", r"from bagel.protocol import \1 as", text, flags=re.MULTILINE)
            path.write_text(text)
            out.append(path)
    return out


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            (PROTO_DIR / path.name).write_text(path.read_text())
            print(f"wrote protocol/{path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
