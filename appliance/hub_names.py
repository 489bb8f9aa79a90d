"""The names of pulled models: Ollama's `name:tag` <-> a Hugging Face-compatible hub's `repo` and `revision`.

`appliance pull OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov` serves the repository's `main` as
`OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov` (Ollama clients also send `...:latest`, which means the same); another
revision (a branch, tag or commit) is the tag: `OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov:v1.0` is revision `v1.0`. A
repository id is the hub's own rule (huggingface_hub's validate_repo_id): `name` or `namespace/name`, letters,
digits, `-`, `_`, `.`, no `--` or `..`, at most 96 characters; so `namespace--name` is a folder name no two
repositories share (appliance/paths.py lays pulled models out by it).

Pure string work: the HTTP workers check a pulled name with it before anything starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote

DEFAULT_REVISION = "main"
LATEST = "latest"  # Ollama's default tag: the default revision
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
REPO_ID = re.compile(rf"^(?:{_PART}/)?{_PART}$")
REPO_ID_MAX = 96
# a git ref or a commit: no spaces, no control characters, no `:` (the tag separator), bounded; each `/`-separated
# part starts with a letter or digit, so none is empty, `.` or `..` (a folder name that would collapse onto the
# repository's folder: `org/name:.` once named every revision) and none looks like an option (`-rf`)
REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*$")
REVISION_MAX = 255


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str = DEFAULT_REVISION

    @property
    def name(self) -> str:
        """The served model name."""
        return self.repo if self.revision == DEFAULT_REVISION else f"{self.repo}:{self.revision}"

    @property
    def folder(self) -> str:
        """Its folder under the pulled models' root: `namespace--name/revision` (a `/` in a revision escaped)."""
        return f"{self.repo.replace('/', '--')}/{quote(self.revision, safe='')}"

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}"


def parse(text: object) -> HubRef:
    """`repo[:revision]` (Ollama's `name[:tag]`; `latest` is the default revision). ValueError saying what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a model name is required: a hub repository, e.g. OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov")
    repo, _, revision = text.strip().partition(":")
    if not revision and text.strip().endswith(":"):
        raise ValueError(f"{text!r}: an empty tag")
    revision = revision or DEFAULT_REVISION
    if revision == LATEST:
        revision = DEFAULT_REVISION
    if len(repo) > REPO_ID_MAX or not REPO_ID.match(repo) or "--" in repo or ".." in repo or repo.endswith("."):
        raise ValueError(
            f"{repo!r} is not a hub repository id (namespace/name: letters, digits, '-', '_', '.'; "
            f"no '--' or '..'; at most {REPO_ID_MAX} characters)"
        )
    if len(revision) > REVISION_MAX or not REVISION.match(revision) or ".." in revision or revision.endswith("."):
        raise ValueError(
            f"{revision!r} is not a revision (a branch, tag or commit of the repository: letters, digits, '.', "
            "'_', '-', parts separated by '/' each starting with a letter or digit)"
        )
    return HubRef(repo, revision)
