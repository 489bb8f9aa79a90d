"""A GGUF of a bench.models random-weight model, for llama.cpp's side of bench.deployed: the same weights as our
export, quantized by llama.cpp itself to a comparable 4-bit type (Q4_K_M by default), without its C++ tools.

llama-cpp-python's sdist ships `vendor/llama.cpp/convert_hf_to_gguf.py` with its `conversion/` package and
`gguf-py/`; it needs `sentencepiece` (--pylib: a folder on PYTHONPATH with it, e.g. made by
`pip install --target DIR sentencepiece==0.2.3`). The converter identifies a BPE tokenizer's pre-tokenizer by
hashing a test string's encoding and refuses unknown hashes; bench.models' tokenizer is a byte-level BPE with
GPT-2's split regex (`ByteLevel`, use_regex), so "gpt-2" is forced. The HF folder is bf16; it is written to an f16
GGUF first (`<name>-f16.gguf`, kept only with --keep-f16), then `llama_cpp.llama_model_quantize` (run by the
--llamacpp-python that serves it, so the quantizer and the server are one build; or --lib-dir: llama.cpp's
built shared libraries with the sdist's ctypes bindings, loaded without the package's __init__ and its server
imports) makes `<name>-<type>.gguf` in `data_dir()/bench/<name>/`.

    python -m bench.gguf --model qwen2.5-1.5b --sdist /tmp/perf-sizes/llama_cpp_python-0.3.36 \\
        --pylib /tmp/perf-sizes/pylib (--llamacpp-python /tmp/llama-venv/bin/python | --lib-dir DIR) [--type Q4_K_M]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from appliance.paths import data_dir

_CONVERT = """
import sys
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import runpy
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""
_QUANTIZE = """
import os, sys, types
if os.environ.get("LLAMA_CPP_LIB_PATH"):  # the sdist's bindings on built libraries, without the package's imports
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [os.environ["LLAMA_CPP_SDIST_PKG"]]
    sys.modules["llama_cpp"] = pkg
    import llama_cpp.llama_cpp as llama_cpp
else:
    import llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = ftype
params.nthread = 2
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
sys.exit(rc)
"""


def gguf_path(name: str, qtype: str = "Q4_K_M") -> Path:
    return data_dir() / "bench" / name / f"{name}-{qtype.lower()}.gguf"


def build(
    name: str, sdist: Path, pylib: Path, llamacpp_python: str | None, lib_dir: Path | None, qtype: str, keep_f16: bool
) -> Path:
    hf = data_dir() / "bench" / name / "hf"
    out = gguf_path(name, qtype)
    if out.exists():
        return out
    f16 = out.with_name(f"{name}-f16.gguf")
    vendor = sdist / "vendor" / "llama.cpp"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(vendor), str(vendor / "gguf-py"), str(pylib)])}
    if not f16.exists():
        cmd = [sys.executable, "-c", _CONVERT, str(hf), "--outtype", "f16", "--outfile", str(f16) + ".partial"]
        subprocess.run(cmd, cwd=vendor, env=env, check=True)
        os.replace(str(f16) + ".partial", f16)
    qenv = dict(os.environ)
    if lib_dir is not None:  # llama.cpp's shared libraries (e.g. a build directory), with the sdist's bindings
        qenv.update(LLAMA_CPP_LIB_PATH=str(lib_dir), LLAMA_CPP_SDIST_PKG=str(sdist / "llama_cpp"))
    python = llamacpp_python or sys.executable
    subprocess.run([python, "-c", _QUANTIZE, str(f16), str(out) + ".partial", qtype], env=qenv, check=True)
    os.replace(str(out) + ".partial", out)
    if not keep_f16:
        f16.unlink()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--sdist", type=Path, required=True, help="the unpacked llama-cpp-python sdist")
    ap.add_argument("--pylib", type=Path, required=True, help="a folder with sentencepiece")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--llamacpp-python", help="a python with llama-cpp-python installed (quantizes)")
    where.add_argument("--lib-dir", type=Path, help="or: a folder with libllama.so / libggml*.so (its build/bin)")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--keep-f16", action="store_true")
    args = ap.parse_args(argv)
    print(build(args.model, args.sdist, args.pylib, args.llamacpp_python, args.lib_dir, args.type, args.keep_f16))
    return 0


if __name__ == "__main__":
    sys.exit(main())
