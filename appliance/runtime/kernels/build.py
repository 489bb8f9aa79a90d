"""Builds the extension library (CMakeLists.txt here) against the installed openvino wheel's headers,
OpenVINOConfig.cmake and TBB, into this package's directory, where `appliance.runtime.kernels` looks for it.

`make venv` runs it after installing the package (and again when a source here changes); the Dockerfile's build
stage runs it with g++ and cmake installed. A missing compiler or cmake, or a failed build, prints one line and
exits 0: the server then runs OpenVINO's kernels (the tests fail under CI=true instead: building it is ours).
`--require` makes any failure exit 1.

    python -m appliance.runtime.kernels.build [--source DIR] [--require]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from appliance.runtime.kernels import ABI, LIBRARY

HERE = Path(__file__).resolve().parent


def build(source: Path, out_dir: Path, abi: int = ABI) -> Path:
    """Configures and builds in a temporary directory (one job: install steps share their box), then copies the
    library to out_dir. `abi`: the version compiled in (kernels.ABI; another only to test the loader's refusal).
    Raises RuntimeError saying why."""
    import openvino

    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found (install g++ and cmake, then `make venv`)")
    cmake_dir = Path(openvino.__file__).resolve().parent / "cmake"
    with tempfile.TemporaryDirectory(prefix="appliance-kernels-") as tmp:
        steps = [
            [
                "cmake",
                *("-S", str(source), "-B", tmp, f"-DOpenVINO_DIR={cmake_dir}", f"-DTBB_DIR={cmake_dir}"),
                f"-DAPPLIANCE_KERNELS_ABI={abi}",
            ],
            ["cmake", "--build", tmp, "--parallel", "1"],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode:
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
                raise RuntimeError(f"{' '.join(step[:2])} failed:\n{tail}")
        out = out_dir / LIBRARY
        tmp_out = out.with_suffix(".so.tmp")
        shutil.copyfile(Path(tmp) / LIBRARY, tmp_out)
        tmp_out.replace(out)  # atomic: a running server keeps the file it mapped
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="build the appliance's OpenVINO kernels extension")
    ap.add_argument("--source", type=Path, default=HERE, help="the directory holding CMakeLists.txt")
    ap.add_argument("--require", action="store_true", help="exit 1 when the library could not be built")
    args = ap.parse_args(argv)
    try:
        out = build(args.source, HERE)
    except (RuntimeError, OSError, ImportError) as exc:
        print(f"kernels: not built, OpenVINO's kernels will serve: {exc}", file=sys.stderr)
        return 1 if args.require else 0
    print(f"kernels: built {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
