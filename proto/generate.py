"""Regenerate the gRPC Python code from the .proto files in this folder.

python proto/generate.py            # writes <name>_pb2.py, <name>_pb2_grpc.py, <name>_pb2.pyi
python proto/generate.py --out DIR  # writes them elsewhere (the staleness test uses this)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ["agent.proto", "controller.proto"]


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    for name in PROTOS:
        args = [
            "protoc",
            f"-I{HERE}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(HERE / name),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {name}")
    written = []
    for path in sorted(out.glob("*_pb2*.py*")):
        text = path.read_text()
        # Generated code imports its siblings as top-level modules; make them package-relative.
        fixed = re.sub(
            r"^import (\w+_pb2) as", r"from flashckpt.proto import \1 as", text, flags=re.M
        )
        path.write_text(fixed)
        written.append(path)
    return written


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=HERE)
    for path in generate(p.parse_args().out):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
