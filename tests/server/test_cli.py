"""`appliance serve`'s engine flags (appliance/options.py, parsed by appliance/cli.py) and the KV pool sizing they
lead to (appliance/runtime/backends/kv_budget.py).

Parsing and validation run without a model (a stub manifest); one test builds a real paged engine on a tiny
random model to check that a bytes budget sizes the pool the backend allocates."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from appliance import cli, host, options
from appliance.runtime.backends import kv_budget
from appliance.settings import EX_CONFIG, ConfigError

ROOT = Path(__file__).resolve().parents[2]
GiB, MiB = 1 << 30, 1 << 20
OPENVINO, ONNX = SimpleNamespace(backend="openvino"), SimpleNamespace(backend="onnx")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No APPLIANCE_* variable of the developer's shell may leak into these tests."""
    for flag in options.SERVE_OPTIONS:
        monkeypatch.delenv(options.env_name(flag), raising=False)


def config(*flags: str, manifest=OPENVINO):
    return options.engine_config(cli.build_parser().parse_args(["serve", *flags]), manifest)


def refused(*flags: str, manifest=OPENVINO) -> str:
    with pytest.raises(ConfigError) as info:
        config(*flags, manifest=manifest)
    message = str(info.value)
    assert message and not message.startswith("appliance: ") and "\n" not in message, message
    return message


# ---------------------------------------------------------------- --kv-cache-size values


@pytest.mark.parametrize(
    "text, want",
    [
        ("2", ("bytes", 2 * GiB)),  # a bare number is GB, as OVMS's cache_size
        ("1.5", ("bytes", int(1.5 * GiB))),
        ("512MB", ("bytes", 512 * MiB)),
        ("512mib", ("bytes", 512 * MiB)),
        ("2GiB", ("bytes", 2 * GiB)),
        ("2 GB", ("bytes", 2 * GiB)),  # GB and GiB are the same: binary, like OVMS
        ("64k", ("bytes", 64 << 10)),
        ("4096b", ("bytes", 4096)),
        ("16384tokens", ("tokens", 16384)),
        ("16384 Tokens", ("tokens", 16384)),
        ("auto", None),
        (" AUTO ", None),
    ],
)
def test_kv_cache_size_values(text, want):
    assert options.parse_kv_cache_size(text) == want


@pytest.mark.parametrize(
    "text", ["", "abc", "0", "-1", "2XB", "2i", "1.5tokens", "0tokens", "16k tokens", "2GB extra", "tokens", ".5"]
)
def test_kv_cache_size_garbage_is_one_clean_line(text):
    with pytest.raises(ConfigError) as info:
        options.parse_kv_cache_size(text)
    assert str(info.value).startswith(f"--kv-cache-size {text!r}: ") and "16384tokens" in str(info.value)


def test_defaults_leave_the_kv_budget_to_auto():
    engine = config()
    assert engine.kv_cache_tokens is None and engine.kv_cache_bytes is None
    assert engine.prefix_caching is True and engine.static is False and engine.kv_cache_precision is None


def test_flags_reach_the_engine_config(tmp_path):
    engine = config(
        "--kv-cache-size",
        "1.5",
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "64",
        "--max-queued",
        "3",
        "--kv-cache-precision",
        "F16",
        "--num-threads",
        "2",
        "--cache-dir",
        str(tmp_path / "ov-cache"),
    )
    assert (engine.kv_cache_bytes, engine.kv_cache_tokens) == (int(1.5 * GiB), None)
    assert (engine.prefix_caching, engine.max_num_seqs, engine.max_num_batched_tokens, engine.max_queued) == (
        False,
        8,
        64,
        3,
    )
    assert (engine.kv_cache_precision, engine.kv_precision(), engine.num_threads) == ("f16", "f16", 2)
    assert engine.cache_dir == str(tmp_path / "ov-cache")
    tokens = config("--kv-cache-size", "4096tokens")
    assert (tokens.kv_cache_tokens, tokens.kv_cache_bytes) == (4096, None)


def test_environment_is_the_fallback_and_a_flag_beats_it(monkeypatch):
    monkeypatch.setenv("APPLIANCE_KV_CACHE_SIZE", "512MB")
    monkeypatch.setenv("APPLIANCE_ENABLE_PREFIX_CACHING", "0")
    monkeypatch.setenv("APPLIANCE_MAX_NUM_BATCHED_TOKENS", "64")
    from_env = config()
    assert (from_env.kv_cache_bytes, from_env.prefix_caching, from_env.max_num_batched_tokens) == (512 * MiB, False, 64)
    flagged = config("--kv-cache-size", "1GB", "--enable-prefix-caching")
    assert (flagged.kv_cache_bytes, flagged.prefix_caching) == (GiB, True)
    monkeypatch.setenv("APPLIANCE_STATIC", "maybe")
    with pytest.raises(ConfigError, match="APPLIANCE_STATIC='maybe' is not a boolean"):
        cli.parse(["config"])


def test_kv_cache_tokens_is_an_alias_and_not_both():
    engine = config("--kv-cache-tokens", "8192")
    assert (engine.kv_cache_tokens, engine.kv_cache_bytes) == (8192, None)
    assert "not both" in refused("--kv-cache-tokens", "8192", "--kv-cache-size", "2")


def test_alias_conflict_across_flag_and_environment(monkeypatch):
    monkeypatch.setenv("APPLIANCE_KV_CACHE_SIZE", "2")
    assert "APPLIANCE_KV_CACHE_SIZE" in refused("--kv-cache-tokens", "8192")


def test_a_size_beyond_the_machine_is_refused(monkeypatch):
    monkeypatch.setattr(host, "read_meminfo", lambda: "MemTotal:  1048576 kB\nMemAvailable:  524288 kB\n")
    assert "more than this machine's memory (1.0 GB)" in refused("--kv-cache-size", "16384")
    assert config("--kv-cache-size", "512MB").kv_cache_bytes == 512 * MiB


def test_checking_a_size_against_the_machine_loads_no_numpy():
    """The memory check reads /proc/meminfo through appliance/host.py: `appliance config` and a reload's checks
    do not load the backends package (numpy) to read one text file."""
    code = (
        "import sys; from types import SimpleNamespace; from appliance import cli, options\n"
        "args = cli.build_parser().parse_args(['serve', '--kv-cache-size', '1GB'])\n"
        "assert options.engine_config(args, SimpleNamespace(backend='openvino')).kv_cache_bytes == 1 << 30\n"
        "print(sorted(m for m in ('numpy', 'openvino') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr + result.stdout


@pytest.mark.parametrize(
    "flags, manifest, words",
    [
        (("--device", "NPU", "--no-static"), OPENVINO, "needs static shapes"),
        (("--static", "--kv-cache-size", "1"), OPENVINO, "do not apply to static shapes"),
        (("--device", "NPU", "--kv-cache-tokens", "4096"), OPENVINO, "do not apply to static shapes"),
        (("--kv-cache-precision", "u8"), ONNX, "do not apply to static shapes"),
        (("--static-context", "512"), OPENVINO, "--static-context applies to static shapes"),
        (("--cache-dir", "/tmp"), ONNX, "ONNX model"),
        (("--kv-cache-precision", "i4"), OPENVINO, "must be u8, f16, f32 or auto"),
        (("--max-num-seqs", "0"), OPENVINO, "--max-num-seqs must be at least 1"),
        (("--kv-cache-tokens", "0"), OPENVINO, "--kv-cache-tokens must be at least 1"),
        (("--max-num-seqs", "64", "--max-num-batched-tokens", "32"), OPENVINO, "must be at least the sequences"),
    ],
)
def test_misplaced_or_invalid_flags_are_refused(flags, manifest, words):
    assert words in refused(*flags, manifest=manifest)


def test_static_knobs():
    engine = config("--static", "--static-context", "256", "--static-batch", "2", "--static-prefill-chunk", "32")
    assert (engine.static, engine.static_context, engine.static_batch, engine.static_prefill_chunk) == (
        True,
        256,
        2,
        32,
    )
    npu = config("--device", "NPU", "--static-batch", "8")  # NPU implies static; ONNX runs slots too
    assert npu.static_batch == 8 and npu.static is False
    assert config("--static-context", "128", manifest=ONNX).static_context == 128
    # 64 sequences asked, but only 4 slots decode per step: a 16-token step budget is enough
    assert config("--static", "--max-num-seqs", "64", "--max-num-batched-tokens", "16").max_num_batched_tokens == 16


# ---------------------------------------------------------------- speculative decoding


def draft_export(directory, backend: str = "openvino"):
    """A directory holding a manifest, as an export has (enough for the CLI's checks; nothing loads it here)."""
    from appliance.manifest import Manifest

    directory.mkdir(parents=True, exist_ok=True)
    shape = dict(num_layers=1, num_attention_heads=1, num_kv_heads=1, head_dim=8, hidden_size=8, vocab_size=16)
    Manifest(
        "draft",
        backend,
        "fp16",
        "m.xml",
        "LlamaForCausalLM",
        "llama",
        **shape,
        max_context=64,
        kv_dtype="f16",
        stateful=True,
    ).save(directory)
    return directory


def test_speculation_flags_reach_the_engine_config(tmp_path, monkeypatch):
    engine = config("--prompt-lookup", "--num-assistant-tokens", "8", "--max-ngram-size", "2")
    assert (engine.prompt_lookup, engine.num_assistant_tokens, engine.max_ngram_size) == (True, 8, 2)
    assert (engine.speculative(), engine.draft_model, engine.speculation_max_batch) == ("prompt_lookup", None, 4)
    draft = draft_export(tmp_path / "draft")
    monkeypatch.chdir(tmp_path)
    engine = config("--draft-model", "draft", "--draft-device", "GPU", "--speculation-max-batch", "2")
    assert (engine.draft_model, engine.draft_device, engine.speculative()) == (str(draft), "GPU", "draft")
    assert engine.speculation_max_batch == 2 and not engine.prompt_lookup
    assert config().speculative() is None  # requests may still turn prompt lookup on (prediction, max_ngram_size)
    assert config("--static").speculative() is None and config(manifest=ONNX).num_assistant_tokens == 5


@pytest.mark.parametrize(
    "flags, manifest, words",
    [
        (("--static", "--prompt-lookup"), OPENVINO, "--prompt-lookup needs paged attention"),
        (("--device", "NPU", "--prompt-lookup"), OPENVINO, "decode one token per slot and step"),
        (("--prompt-lookup",), ONNX, "ONNX models decode one token per slot"),
        (("--num-assistant-tokens", "0"), OPENVINO, "--num-assistant-tokens must be between 1 and 32"),
        (("--num-assistant-tokens", "33"), OPENVINO, "--num-assistant-tokens must be between 1 and 32"),
        (("--max-ngram-size", "0"), OPENVINO, "--max-ngram-size must be between 1 and 16"),
        (("--speculation-max-batch", "0"), OPENVINO, "--speculation-max-batch must be at least 1"),
        (("--draft-device", "GPU"), OPENVINO, "--draft-device needs --draft-model"),
        (("--draft-model", "/nonexistent/draft"), OPENVINO, "is not a model export (no appliance_manifest.json there)"),
    ],
)
def test_misplaced_or_invalid_speculation_flags_are_refused(flags, manifest, words):
    assert words in refused(*flags, manifest=manifest)


def test_draft_model_checks(tmp_path):
    draft = str(draft_export(tmp_path / "draft"))
    assert "not both" in refused("--prompt-lookup", "--draft-model", draft)
    assert "--draft-model needs paged attention" in refused("--static", "--draft-model", draft)
    assert "a draft must be OpenVINO" in refused("--draft-model", str(draft_export(tmp_path / "onnx", "onnx")))
    assert config("--draft-model", "default").draft_model  # the model itself may be its own draft: allowed


# ---------------------------------------------------------------- one declaration: flags, env, help, docs

# Every serve flag as it was before the flags were derived from the dataclasses: (type, default before the
# environment). A rename, a new default or a lost flag fails here.
FLAGS = {
    "model": (str, "default"),
    "served-model-name": (str, None),
    "host": (str, "127.0.0.1"),
    "port": (int, 8000),
    "workers": (int, 1),
    "threads": (int, 32),
    "config": (str, None),
    "embedding-model": (str, "default"),
    "encoder-nice": (int, 19),
    "encoder-sched": (str, "idle"),
    "api-key-file": (str, None),
    "admin-key-file": (str, None),
    "allow-unauthenticated": (bool, False),
    "tls-certfile": (str, None),
    "tls-keyfile": (str, None),
    "allowed-hosts": (str, None),
    "max-body-bytes": (int, 16 * MiB),
    "image-url-hosts": (str, None),
    "image-url-timeout": (float, 10.0),
    "graceful-timeout": (int, 30),
    "request-timeout": (float, 30.0),
    "send-timeout": (float, 30.0),
    "keepalive-timeout": (int, 5),
    "client-max-connections": (int, 0),
    "client-max-generations": (int, 0),
    "tool-parser": (str, "auto"),
    "reasoning-parser": (str, "auto"),
    "responses-retention": (float, 2592000.0),
    "responses-max-bytes": (int, 268435456),
    "state-dir": (str, None),
    "keep-alive": (str, "-1"),
    "models-memory-budget": (str, "none"),
    "models-load-wait": (float, 60.0),
    "serve-pulled": (bool, True),
    "log-level": (str, "info"),
    "access-log": (bool, False),
    "otlp-endpoint": (str, None),
    "device": (str, "CPU"),
    "precision": (str, "default"),
    "kernels": (str, "auto"),
    "kv-cache-precision": (str, "auto"),
    "kv-cache-size": (str, None),
    "kv-disk-dir": (str, None),
    "kv-disk-bytes": (int, 2 << 30),
    "kv-disk-max-age": (float, 604800.0),
    "kv-cache-tokens": (int, None),
    "max-num-seqs": (int, 32),
    "max-num-batched-tokens": (int, 512),
    "max-queued": (int, 256),
    "enable-prefix-caching": (bool, True),
    "prefix-cache-sharing": (str, "keys"),
    "image-cache-bytes": (int, 64 << 20),
    "static": (bool, None),
    "static-context": (int, None),
    "static-batch": (int, None),
    "static-prefill-chunk": (int, None),
    "num-threads": (int, None),
    "cache-dir": (str, "auto"),
    "max-prompt-len": (int, None),
    "prompt-lookup": (bool, False),
    "draft-model": (str, None),
    "draft-device": (str, None),
    "num-assistant-tokens": (int, 5),
    "max-ngram-size": (int, 3),
    "speculation-max-batch": (int, 4),
    "max-tokens-limit": (int, None),
    "max-prompts": (int, 256),
    "max-embedding-inputs": (int, 2048),
    "max-images": (int, 8),
    "max-image-bytes": (int, 10 * 2**20),
    "max-image-pixels": (int, 16_777_216),
    "max-embedding-tokens": (int, 65536),
    "max-rerank-documents": (int, 1000),
    "max-n": (int, 20),
    "max-best-of": (int, 20),
    "max-prompt-logprobs": (int, 65536),
    "max-setup-work": (int, 524288),
    "max-generated-logprobs": (int, 524288),
    "max-messages": (int, 1024),
}


def test_flags_keep_their_names_types_and_defaults():
    assert {flag: (o.kind, o.default) for flag, o in options.SERVE_OPTIONS.items()} == FLAGS
    args = cli.build_parser().parse_args(["serve"])
    assert {flag: getattr(args, flag.replace("-", "_")) for flag in FLAGS} == {f: d for f, (_, d) in FLAGS.items()}
    assert options.env_name("max-num-batched-tokens") == "APPLIANCE_MAX_NUM_BATCHED_TOKENS"
    timed = cli.build_parser().parse_args(["serve", "--request-timeout", "2.5", "--port", "9000"])
    assert (timed.request_timeout, timed.port) == (2.5, 9000)


def test_every_flag_is_a_declared_field():
    """Each flag's default is its field's, or the flag's own where the field declares one (`cli=`), and its help
    is the field's."""
    from dataclasses import MISSING

    for flag, (_, f) in options.FIELDS.items():
        option = options.SERVE_OPTIONS[flag]
        assert option.default == (f.metadata["cli"] if "cli" in f.metadata else f.default), flag
        assert f.default is not MISSING or "cli" in f.metadata, f"{flag}: a required field needs the flag's default"
        assert option.help == f.metadata["help"] and "|" not in option.help


def test_python_api_and_serve_share_their_defaults_but_the_kv_pool_and_the_compile_cache():
    """`EngineConfig()` and a bare `appliance serve` configure the same engine, except the KV pool (a fixed token
    count for the library, auto for the server) and the compile cache (off for the library, on for the server):
    said once, at EngineConfig.kv_cache_tokens and EngineConfig.cache_dir."""
    from dataclasses import asdict

    from appliance.config import EngineConfig
    from appliance.paths import compile_cache_dir

    served, api = asdict(config()), asdict(EngineConfig())
    assert {k for k in api if served[k] != api[k]} == {"kv_cache_tokens", "cache_dir"}
    assert served["cache_dir"] == str(compile_cache_dir()) and api["cache_dir"] is None
    assert served["kv_cache_tokens"] is None and served["kv_cache_bytes"] is None and api["kv_cache_tokens"] > 0


def test_help_shows_each_environment_variable_and_the_declared_default(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in FLAGS:
        assert f"--{flag}" in text and options.env_name(flag) in text
    # the static knobs are "not given" to the parser but show the engine's default; nothing writes it twice
    assert "(env APPLIANCE_STATIC_CONTEXT, default 1024)" in text
    assert "(env APPLIANCE_PORT, default 8000)" in text and "(env APPLIANCE_ACCESS_LOG=1/0, default off)" in text
    assert "(env APPLIANCE_KV_CACHE_SIZE, default auto)" in text


def test_options_table_in_docs_is_the_declared_one(capsys):
    """docs/serving.md's Options table is exactly `options_table()`: one row per flag, its default and help."""
    from pathlib import Path

    table = options.options_table()
    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    assert table in doc, "regenerate the table: python -m appliance.cli --options-table"
    rows = {
        line.split("|")[1].split("`")[1].removeprefix("--"): line.split("|")[2].strip()
        for line in table.splitlines()[2:]
    }
    assert set(rows) == set(FLAGS)
    assert (rows["static-context"], rows["max-num-seqs"], rows["kv-cache-size"], rows["access-log"]) == (
        "1024",
        "32",
        "auto",
        "off",
    )
    assert cli.main(["--options-table"]) == 0 and capsys.readouterr().out == table


# ---------------------------------------------------------------- kv_budget.pool_blocks: explicit and auto


def budget_config(**kw):
    return SimpleNamespace(**{"kv_cache_bytes": None, "kv_cache_tokens": None, "max_num_seqs": 32, **kw})


def meminfo(monkeypatch, available_kb: int | None):
    text = "MemTotal:  99999999 kB\n" + (f"MemAvailable:  {available_kb} kB\n" if available_kb is not None else "")
    monkeypatch.setattr(host, "read_meminfo", lambda: text)


BLOCK = MiB  # bytes per block in these cases: 32 seqs x 32 blocks (1024 / 32 tokens) = a 1 GiB ceiling


@pytest.mark.parametrize(
    "available, want",
    [
        (64 * GiB, GiB),  # plenty: the ceiling, what 32 full-context sequences can use
        (2 * GiB, GiB // 2),  # a quarter of what is available
        (600 * MiB, 256 * MiB),  # the floor
        (None, 256 * MiB),  # no /proc/meminfo: the floor
    ],
)
def test_auto_budget_bounds(monkeypatch, caplog, available, want):
    meminfo(monkeypatch, None if available is None else available // 1024)
    with caplog.at_level(logging.INFO, logger="appliance.runtime.backends.kv_budget"):
        blocks = kv_budget.pool_blocks(budget_config(), 32, BLOCK, 1024)
    assert blocks * BLOCK == want
    assert 256 * MiB <= blocks * BLOCK <= GiB
    assert [r.getMessage().startswith("KV cache size auto:") for r in caplog.records] == [True]


def test_auto_budget_ceiling_below_the_floor(monkeypatch):
    """A small model's whole need (4 sequences x 1024 tokens = 128 blocks of 64 KiB = 8 MiB) is less than the
    floor: the pool is that need, not 256 MiB."""
    meminfo(monkeypatch, 100)
    assert kv_budget.pool_blocks(budget_config(max_num_seqs=4), 32, 64 << 10, 1000) == 4 * 32


def test_explicit_budgets(monkeypatch):
    monkeypatch.setattr(host, "read_meminfo", lambda: pytest.fail("an explicit budget must not read meminfo"))
    assert kv_budget.pool_blocks(budget_config(kv_cache_bytes=10 * BLOCK + 5), 32, BLOCK, 1024) == 10
    assert kv_budget.pool_blocks(budget_config(kv_cache_tokens=100), 32, BLOCK, 1024) == 4  # rounded up
    assert kv_budget.pool_blocks(budget_config(kv_cache_tokens=100, kv_cache_bytes=2 * BLOCK), 32, BLOCK, 1024) == 2
    with pytest.raises(ValueError, match="smaller than one block"):
        kv_budget.pool_blocks(budget_config(kv_cache_bytes=BLOCK - 1), 32, BLOCK, 1024)


# ---------------------------------------------------------------- a real paged engine on a bytes budget


def test_paged_backend_sizes_its_pool_from_a_bytes_budget(exported):
    from appliance.config import EngineConfig
    from appliance.params import SamplingParams
    from appliance.runtime.engine import Engine, PromptTooLong

    out, manifest = exported("llama", "openvino", "fp32")
    # f32 KV: a block is layers x (key + value) x kv_heads x block_size x head_dim x 4 bytes
    per_token = manifest.num_layers * 2 * manifest.num_kv_heads * manifest.head_dim * 4
    budget = int(5.5 * 32 * per_token)
    engine = Engine(out, EngineConfig(precision="f32", kv_cache_bytes=budget))
    try:
        backend = engine.backend
        assert backend.bytes_per_block == backend.block_size * per_token
        assert budget - backend.bytes_per_block < backend.num_blocks * backend.bytes_per_block <= budget
        assert (
            backend.cache_bytes
            == backend.num_blocks * backend.bytes_per_block
            == engine.pool.num_blocks * backend.bytes_per_block
        )
        assert backend.kv_precision == "f32"
        # the pool is smaller than the model's context: longer requests are refused, shorter ones run
        assert engine.max_context == backend.num_blocks * backend.block_size < manifest.max_context
        with pytest.raises(PromptTooLong):
            engine.submit([5] * engine.max_context, SamplingParams(max_tokens=1))
        assert engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))[0].completion_tokens == 4
    finally:
        engine.shutdown()


def test_paged_backend_auto_budget_is_the_ceiling_for_a_tiny_model(exported):
    """The tiny model's ceiling (32 sequences x its whole context) is far below the 256 MiB floor, so auto is
    exactly that ceiling whatever memory this machine has free."""
    from appliance.config import EngineConfig
    from appliance.runtime.engine import Engine

    out, manifest = exported("llama", "openvino", "fp32")
    engine = Engine(out, EngineConfig(precision="f32", kv_cache_tokens=None, max_num_seqs=32))
    try:
        b = engine.backend
        assert 32 * -(-manifest.max_context // b.block_size) * b.bytes_per_block < kv_budget.AUTO_FLOOR
        assert b.num_blocks == 32 * -(-manifest.max_context // b.block_size)
        assert engine.max_context == manifest.max_context
    finally:
        engine.shutdown()


def test_an_invalid_environment_value_is_refused_unless_its_flag_overrides_it(monkeypatch):
    monkeypatch.setenv("APPLIANCE_PORT", "tcp://10.43.0.7:8000")  # what Kubernetes sets for a Service `appliance`
    with pytest.raises(ConfigError, match="APPLIANCE_PORT='tcp://10.43.0.7:8000' is not a valid int"):
        cli.parse(["config"])
    assert cli.parse(["config", "--port", "9000"]).port == 9000
    monkeypatch.setenv("APPLIANCE_ACCESS_LOG", "maybe")
    with pytest.raises(ConfigError, match="is not a boolean"):
        cli.parse(["config", "--port", "9000"])


def test_the_state_dir_variable_is_its_flags():
    """appliance/paths.py reads APPLIANCE_STATE_DIR (the pull subprocess and `appliance pull` have no flags): the
    same name as --state-dir's variable."""
    from appliance import paths

    assert options.env_name("state-dir") == paths.STATE_DIR_ENV


def test_a_misspelt_environment_variable_refuses_the_start(tmp_path):
    """On a box configured through an env file a typo was silently ignored (APPLIANCE_WORKRES=2: one worker, exit
    0). A name close to a setting's is refused with one line naming it (exit 78, before anything loads)."""
    env = {**os.environ, "APPLIANCE_WORKRES": "2", "APPLIANCE_DATA_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == EX_CONFIG, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "appliance: APPLIANCE_WORKRES is not a setting: did you mean APPLIANCE_WORKERS? (`appliance serve --help`)"
    )


def test_unknown_environment_variables_far_from_any_setting_are_warned_about(caplog):
    """Another tool's APPLIANCE_* name: one warning line, not refused; the ones Kubernetes sets for a Service named
    `appliance`, the server's own and the settings' are not mentioned."""
    with pytest.raises(ConfigError, match="did you mean APPLIANCE_KV_CACHE_SIZE"):
        cli.check_variables({"APPLIANCE_KV_CACHE": "1GB"})
    caplog.set_level(logging.WARNING, logger="appliance.serve")
    quiet = {
        "APPLIANCE_SERVICE_HOST": "10.0.0.1",
        "APPLIANCE_SERVICE_PORT_HTTP": "8000",
        "APPLIANCE_PORT_8000_TCP_ADDR": "10.0.0.1",
        "APPLIANCE_DATA_DIR": "/var/lib/appliance",
        "APPLIANCE_STATE_DIR": "/var/lib/appliance/state",
        "APPLIANCE_WORKERS": "2",
        # the kernels' own variables sit close to APPLIANCE_KERNELS (difflib 0.89): read by the runtime, not typos
        "APPLIANCE_KERNELS_ISA": "avx2",
        "APPLIANCE_KERNELS_LIB": "/tmp/lib.so",
        "APPLIANCE_KERNELS_MIN_WEIGHTS": "0",
    }
    cli.check_variables({**quiet, "APPLIANCE_BACKUP_BUCKET": "s3://x"})
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["APPLIANCE_BACKUP_BUCKET is not a setting of appliance serve: ignored"], warned


def test_the_body_limit_must_carry_one_image_at_the_image_limit():
    """An image of --max-image-bytes travels as base64 (4/3 of its bytes) inside a body of at most --max-body-bytes:
    the defaults carry one with room for the rest of the request, and a pair that cannot is refused at start-up,
    naming both ways out, instead of every such image answering 413."""
    from appliance.limits import IMAGE_BODY_ROOM, base64_chars, image_body_bytes

    defaults = cli.build_parser().parse_args(["serve"])
    options.check_server(defaults)
    assert defaults.max_body_bytes >= image_body_bytes(defaults.max_image_bytes) > defaults.max_image_bytes * 4 // 3
    assert image_body_bytes(3 * MiB) == base64_chars(3 * MiB) + IMAGE_BODY_ROOM == 4 * MiB + IMAGE_BODY_ROOM
    fits = ["serve", "--max-image-bytes", str(3 * MiB), "--max-body-bytes", str(image_body_bytes(3 * MiB))]
    options.check_server(cli.build_parser().parse_args(fits))
    with pytest.raises(ConfigError) as info:
        options.check_server(cli.build_parser().parse_args([*fits[:-1], str(image_body_bytes(3 * MiB) - 1)]))
    assert str(info.value) == (
        f"--max-body-bytes {image_body_bytes(3 * MiB) - 1} cannot carry one image of --max-image-bytes {3 * MiB} "
        f"(base64: {4 * MiB} bytes, and {IMAGE_BODY_ROOM} for the rest of the request): raise --max-body-bytes to "
        f"at least {image_body_bytes(3 * MiB)} or lower --max-image-bytes to at most {3 * MiB - 3}"
    )
    with pytest.raises(ConfigError, match=r"raise --max-body-bytes to at least \d+$"):  # no image fits at all
        options.check_server(cli.build_parser().parse_args(["serve", "--max-body-bytes", str(MiB)]))
