"""`python -m appliance.pull --json NAME`: the child process of a server's /api/pull (appliance/ollama_api/pull.py)."""

import argparse
import sys

from appliance.pull.command import add_arguments, main, stop_with_parent

if __name__ == "__main__":  # imported (tests/test_architecture.py imports every module), it runs nothing
    stop_with_parent()
    parser = argparse.ArgumentParser(prog="python -m appliance.pull")
    add_arguments(parser.add_subparsers(dest="command", required=True))
    sys.exit(main(parser.parse_args(["pull", *sys.argv[1:]])))
