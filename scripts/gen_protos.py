"""Generate the fenced stubs in services/common/pb/ from protos/ (grpcio-tools, pinned with protobuf).

usage: python scripts/gen_protos.py [OUT_DIR]   (default: services/common/pb)
Imports in the generated gRPC module are made package-relative, so the stubs need no sys.path.
"""

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "protos" / "meshserve" / "v1" / "meshserve.proto"


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{PROTO.parent}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
                      f"--grpc_python_out={out}", str(PROTO)])
    if rc != 0:
        raise SystemExit(f"protoc failed ({rc})")
    grpc_file = out / "meshserve_pb2_grpc.py"
    grpc_file.write_text(grpc_file.read_text().replace("import meshserve_pb2 as", "from . import meshserve_pb2 as"))
    (out / "__init__.py").write_text('"""Generated from protos/ by scripts/gen_protos.py. Never edit by hand."""\n')


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "services" / "common" / "pb")
