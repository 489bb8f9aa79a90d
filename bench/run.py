"""Batch-1 decode speed and time-to-first-token: our engine vs openvino_genai.LLMPipeline on the same IR.

The second name of bench.batch1_paired (one benchmark, one implementation): engine, LLMPipeline and the CB
pipeline interleaved, rotating which goes first on every run, LLMPipeline also timed by its own perf counters.
`--formats` picks the default model's exports (`--formats fp16 int8` = `--models default-fp16 default-int8`);
every other option is bench.batch1_paired's (see its --help).

    python -m bench.run [--formats fp16 int8] [--runs 9] [--prompt-len 128] [--new-tokens 128] [--quick] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys

from bench import batch1_paired


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--formats", nargs="+")
    ap.add_argument("-h", "--help", action="store_true")
    args, rest = ap.parse_known_args(argv)
    if args.help:
        print(__doc__)
        return batch1_paired.main(["--help"])
    if args.formats:
        rest = ["--models", *(f"default-{fmt}" for fmt in args.formats), *rest]
    return batch1_paired.main(rest)


if __name__ == "__main__":
    sys.exit(main())
