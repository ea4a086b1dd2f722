#!/usr/bin/env python3
"""Generate the Python API from proto/ (one command), or check that the committed code is not stale.

    python scripts/genproto.py          # regenerate ghostgpu/{v1,k8s}/*_pb2*.py
    python scripts/genproto.py --check  # exit 1 if regenerating would change anything

Reproducible because grpcio-tools is pinned in pyproject.toml. A module's path follows its file's
path under proto/ (proto/ghostgpu/v1/x.proto -> ghostgpu/v1/x_pb2.py), never a package named
`proto`; the Kubernetes APIs keep their own proto packages (runtime.v1, v1) in ghostgpu/k8s.
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
OUT_PACKAGES = (Path("ghostgpu") / "v1", Path("ghostgpu") / "k8s")


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *(str(p) for p in protos)]
    if protoc.main(args) != 0:
        raise SystemExit("genproto: protoc failed (see above)")
    generated = [p for pkg in OUT_PACKAGES for p in sorted((out_root / pkg).glob("*_pb2*.py*"))]
    for path in generated:  # grpc stubs for files without services are empty boilerplate
        if path.name.endswith("_pb2_grpc.py") and "class " not in path.read_text():
            path.unlink()
    return [p.relative_to(out_root) for p in generated if p.exists()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        names = {str(p) for p in fresh}
        committed = {str(p.relative_to(ROOT))
                     for pkg in OUT_PACKAGES for p in (ROOT / pkg).glob("*_pb2*.py*")}
        if args.check:
            stale = sorted(names ^ committed)
            stale += [n for n in sorted(names & committed)
                      if not filecmp.cmp(Path(tmp) / n, ROOT / n, shallow=False)]
            if stale:
                print(f"genproto: generated code is stale: {', '.join(stale)}; "
                      "run python scripts/genproto.py", file=sys.stderr)
                return 1
            print(f"genproto: {len(names)} generated files up to date")
            return 0
        for pkg in OUT_PACKAGES:
            (ROOT / pkg).mkdir(parents=True, exist_ok=True)
            (ROOT / pkg / "__init__.py").touch()
        for name in committed - names:
            (ROOT / name).unlink()
        for path in fresh:
            shutil.copyfile(Path(tmp) / path, ROOT / path)
        print(f"genproto: wrote {len(fresh)} files under {', '.join(map(str, OUT_PACKAGES))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
