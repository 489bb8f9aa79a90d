"""An ONNX export whose weights are in an external data file (every export past 2 GiB) loads from a read-only
model directory and generates what the same model with inline weights does; loading writes nothing beside it.

The model directory is read-only as the unit (ProtectSystem=strict, root-owned /var/lib/appliance) and the image
(0555 directories) make it. Run as root (the box's case, where mode bits do not stop a write) the load runs in a
private mount namespace over a read-only bind mount of the directory; as another user the directory is chmod
0555. Either way the child first checks that it cannot write there, so the test cannot pass on a writable one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.config import EngineConfig
from appliance.runtime.engine import Engine
from appliance.runtime.tokenizer import Tokenizer
from tests.runtime.test_parity import engine_greedy

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello world! How are you today?", "def main():\n"]
NEW_TOKENS = 12
CONFIG = dict(precision="f32", static_context=128, static_batch=2, max_num_batched_tokens=16)

# the child: refuse to run on a writable directory, then load and generate greedily
CHILD = """
import json, sys
from pathlib import Path
from appliance.config import EngineConfig
from appliance.runtime.engine import Engine
from tests.runtime.test_parity import engine_greedy
model, prompts, new_tokens = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
config = json.loads(sys.argv[4])
try:
    (model / "probe").write_text("x")
except OSError:
    pass
else:
    sys.exit("the model directory is writable: the test proves nothing")
engine = Engine(model, EngineConfig(**config))
try:
    print(json.dumps(engine_greedy(engine, prompts, new_tokens)))
finally:
    engine.shutdown()
"""


@pytest.fixture(scope="module")
def external_export(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from export import onnx_backend
    from export.exporter import export_model

    out = tmp_path_factory.mktemp("onnx-external") / "gpt2-onnx-fp32"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onnx_backend, "EXTERNAL_DATA_THRESHOLD", 0)  # every tensor to model.onnx_data
        manifest = export_model(tiny("gpt2"), out, "onnx", "fp32")
    assert (out / onnx_backend.DATA_FILE).stat().st_size > (out / manifest.model_file).stat().st_size
    return out


def _read_only_command(model: Path) -> list[str]:
    if os.geteuid() != 0:
        for p in [model, *model.iterdir()]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        return []
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("root without a private mount namespace (unshare --mount): no way to make a read-only dir")
    mount = 'mount --bind -o ro "$1" "$1" && shift && exec "$@"'
    return [unshare, "--mount", "--propagation", "private", "sh", "-c", mount, "sh", str(model)]


def test_external_data_export_loads_read_only_and_generates(external_export: Path, exported) -> None:
    inline, _ = exported("gpt2", "onnx", "fp32")  # the same tiny model, its weights inside model.onnx
    tok = Tokenizer.from_dir(inline)
    prompts = [tok.encode(p) for p in PROMPTS]
    engine = Engine(inline, EngineConfig(**CONFIG))
    try:
        want = engine_greedy(engine, prompts, NEW_TOKENS)
    finally:
        engine.shutdown()

    before = sorted(p.name for p in external_export.iterdir())
    prefix = _read_only_command(external_export)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    args = [str(external_export), json.dumps(prompts), str(NEW_TOKENS), json.dumps(CONFIG)]
    done = subprocess.run(
        [*prefix, sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == want
    assert sorted(p.name for p in external_export.iterdir()) == before  # nothing written beside the model


def test_external_data_load_writes_nothing_in_process(external_export: Path) -> None:
    """In this process too (no read-only mount): the model directory is left as the export made it."""
    before = {p.name: p.stat().st_mtime_ns for p in external_export.iterdir()}
    engine = Engine(external_export, EngineConfig(**CONFIG))
    try:
        tok = Tokenizer.from_dir(external_export)
        assert len(engine_greedy(engine, [tok.encode(PROMPTS[0])], 4)[0]) == 4
    finally:
        engine.shutdown()
    assert {p.name: p.stat().st_mtime_ns for p in external_export.iterdir()} == before
