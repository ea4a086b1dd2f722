#!/usr/bin/env python3
"""Generate the Python API from proto/ (one command), or check that the committed code is not stale.

    python scripts/genproto.py          # regenerate ghostgpu/v1/*_pb2*.py
    python scripts/genproto.py --check  # exit 1 if regenerating would change anything

Reproducible because grpcio-tools is pinned in pyproject.toml; the generated modules land in the
`ghostgpu.v1` package (from `package ghostgpu.v1;`), never in a package named `proto`.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_PACKAGE = Path("ghostgpu") / "v1"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *(str(p) for p in protos)]
    if protoc.main(args) != 0:
        raise SystemExit("genproto: protoc failed (see above)")
    generated = sorted((out_root / OUT_PACKAGE).glob("*_pb2*.py*"))
    for path in generated:  # grpc stubs for files without services are empty boilerplate
        if path.name.endswith("_pb2_grpc.py") and "class " not in path.read_text():
            path.unlink()
    return sorted((out_root / OUT_PACKAGE).glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    target = ROOT / OUT_PACKAGE
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        names = {p.name for p in fresh}
        committed = {p.name for p in target.glob("*_pb2*.py*")}
        if args.check:
            stale = sorted(names ^ committed)
            stale += [n for n in sorted(names & committed)
                      if not filecmp.cmp(Path(tmp) / OUT_PACKAGE / n, target / n, shallow=False)]
            if stale:
                print(f"genproto: generated code is stale: {', '.join(stale)}; "
                      "run python scripts/genproto.py", file=sys.stderr)
                return 1
            print(f"genproto: {len(names)} generated files up to date")
            return 0
        target.mkdir(parents=True, exist_ok=True)
        (target / "__init__.py").touch()
        for name in committed - names:
            (target / name).unlink()
        for path in fresh:
            shutil.copyfile(path, target / path.name)
        print(f"genproto: wrote {len(fresh)} files to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
