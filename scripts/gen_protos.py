"""Regenerate the committed protobuf/gRPC code of protos/duelq/v1/learner.proto.

Usage: ``python scripts/gen_protos.py [--out DIR]`` (default: in place, next to
the proto).  The generator is pinned to grpcio-tools 1.84.0 (the ``test``
extra): its gencode runs on the GPU image's grpcio 1.84.0 / protobuf 7.36 and
on the newest releases, whereas 1.84.1+ gencode refuses grpcio 1.84.0.
tests/test_protos.py checks that regenerating changes nothing.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata, resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTOS = ("duelq/v1/learner.proto",)
DESCRIPTOR_SET = "duelq/v1/learner.binpb"
GENERATOR = "grpcio-tools"
GENERATOR_VERSION = "1.84.0"


def generator_version() -> str | None:
    """Installed grpcio-tools version, or None."""
    try:
        return metadata.version(GENERATOR)
    except metadata.PackageNotFoundError:
        return None


def generate(out_dir: Path) -> None:
    """Write learner_pb2.py, learner_pb2.pyi, learner_pb2_grpc.py and learner.binpb under
    ``out_dir``: the last is the FileDescriptorSet with the proto's comments (source info),
    which server reflection serves (the gencode's descriptors carry no comments)."""
    version = generator_version()
    if version != GENERATOR_VERSION:
        raise RuntimeError(f"need {GENERATOR}=={GENERATOR_VERSION} (pip install -e '.[test]'), "
                           f"found {version}")
    from grpc_tools import protoc

    (out_dir / DESCRIPTOR_SET).parent.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
            f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
            "--include_source_info", f"--descriptor_set_out={out_dir / DESCRIPTOR_SET}",
            *(str(PROTO_ROOT / p) for p in PROTOS)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see its message above")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT,
                        help="output root (default: protos/, in place)")
    args = parser.parse_args(argv)
    try:
        generate(args.out)
    except RuntimeError as exc:
        print(f"gen_protos: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
