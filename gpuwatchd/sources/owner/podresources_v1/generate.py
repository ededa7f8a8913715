"""Regenerate api_pb2.py, api_pb2.pyi and api_pb2_grpc.py from api.proto.

    pip install 'grpcio-tools>=1.85' && python gpuwatchd/sources/owner/podresources_v1/generate.py

The proto is given to protoc by its path from the repository root, so the generated
service module imports the messages as `gpuwatchd.sources.owner.podresources_v1.api_pb2`
(a package import, not a top-level `api_pb2`). The proto's own package stays `v1`: it
names the RPC on the wire (`/v1.PodResourcesLister/List`), which the kubelet answers.
Provenance of api.proto: README.md beside this file.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]  # the repository root: gpuwatchd/sources/owner/podresources_v1


def main() -> int:
    from grpc_tools import protoc  # the test extra does not need it: only this script does

    proto = (HERE / "api.proto").relative_to(ROOT)
    include = Path(protoc.__file__).parent / "_proto"  # protoc's well-known types
    args = [
        "protoc",
        f"--proto_path={ROOT}",
        f"--proto_path={include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        str(proto),
    ]
    return protoc.main(args)


if __name__ == "__main__":
    sys.exit(main())
