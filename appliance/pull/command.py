"""`appliance pull` and `appliance rm` on the command line, and `python -m appliance.pull --json NAME`, the child
process a server's /api/pull runs (appliance/ollama_api/pull.py): the arguments, the progress (a line per file on
a terminal, redrawn in place; Ollama's status objects as JSON lines with --json), the exit status, and the child's
end with the worker that relays it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys

from appliance import hub_names, paths
from appliance.pull.hub import PullError
from appliance.pull.store import pull, remove

PR_SET_PDEATHSIG = 1


def add_arguments(sub) -> None:
    """`appliance pull` and `appliance rm` (appliance/cli.py)."""
    pull_cmd = sub.add_parser(
        "pull",
        help="download a model from a Hugging Face-compatible hub (HF_ENDPOINT) and make it servable",
        description="Download REPO[:REVISION] (an OpenVINO IR repository as is; safetensors weights exported where "
        "the export tools are installed) into the data dir's models/hub/, checked, then serve it with "
        "`appliance serve --model REPO[:REVISION]`. The hub is $HF_ENDPOINT (default https://huggingface.co), the "
        "token $HF_TOKEN. An interrupted pull resumes.",
    )
    pull_cmd.add_argument("model", help="a hub repository, e.g. OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov[:revision]")
    pull_cmd.add_argument(
        "--weight-format",
        choices=("int4", "int8", "fp16", "fp32"),
        help="safetensors repositories: the export's weight format (default: the one served on this CPU)",
    )
    pull_cmd.add_argument("--json", action="store_true", help="Ollama's status objects on stdout, one a line")
    rm = sub.add_parser(
        "rm",
        help="delete a pulled model",
        description="Delete a model `appliance pull` downloaded, or what an interrupted pull of it left (a running "
        "server: DELETE /api/delete).",
    )
    rm.add_argument("model", help="the pulled model's name, REPO[:REVISION]")


class Terminal:
    """Progress on stderr: one line per file, redrawn in place on a terminal."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.open = False
        self.last = 0.0

    def __call__(self, event: dict, file: str | None = None) -> None:
        if "completed" not in event:
            self._end()
            print(event["status"], file=sys.stderr, flush=True)
            return
        done, total = event["completed"], event["total"] or 1
        text = f"{event['status']} {file or ''}: {100 * done // total:3d}% {done / 1e6:.1f}/{total / 1e6:.1f} MB"
        if self.tty:
            print(f"\r{text}", end="", file=sys.stderr, flush=True)
            self.open = True
            if done >= total:
                self._end()
        elif done >= total:
            print(text, file=sys.stderr, flush=True)

    def _end(self) -> None:
        if self.open:
            print(file=sys.stderr, flush=True)
            self.open = False


def json_lines(event: dict, file: str | None = None) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def main(args: argparse.Namespace) -> int:
    """`appliance pull` / `appliance rm`: 0 done, 1 failed (one line on stderr; with --json also an error line)."""
    try:
        ref = hub_names.parse(args.model)
    except ValueError as exc:
        return fail(args, str(exc), 400)
    if args.command == "rm":
        if not remove(paths.pulled_model_dir(ref)):  # the model, or a partial download of it
            return fail(args, f"no pulled model {ref.name} in {paths.pulled_models_dir()}", 404)
        print(f"deleted {ref.name}", file=sys.stderr)
        return 0
    emit = json_lines if args.json else Terminal()
    try:
        folder = pull(ref, emit, args.weight_format)
    except PullError as exc:
        return fail(args, str(exc), exc.status)
    if not args.json:
        print(f"pulled {ref.name} into {folder}: `appliance serve --model {ref.name}`", file=sys.stderr)
    return 0


def fail(args: argparse.Namespace, message: str, status: int) -> int:
    if getattr(args, "json", False):
        json_lines({"error": message, "code": status})
    print(f"appliance: {message}", file=sys.stderr)
    return 1


def stop_with_parent() -> None:
    """The child of a server's /api/pull (appliance/ollama_api/pull.py) ends with the worker that relays it."""
    parent = os.environ.get("APPLIANCE_PULL_PARENT")
    if parent and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != int(parent):  # gone before the line above
            sys.exit(1)
