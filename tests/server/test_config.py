"""One configuration source (appliance/cli.py `parse`, appliance/server/config_file.py): flag > APPLIANCE_* >
--config file > default, OVMS's model_config_list with per-model engine settings, `appliance config`, and the
re-read a config reload does.

No server and no engine: the exports are fake manifests (the settings are checked, nothing loads), so the whole
file runs in about a second."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from appliance import cli, options
from appliance.manifest import Manifest
from appliance.paths import served_weight_format
from appliance.server import config_file
from appliance.settings import ConfigError, ServeSettings

ROOT = Path(__file__).resolve().parents[2]
SERVED = f"openvino-{served_weight_format()}"  # the default model's served export folder on this CPU
GiB = 1 << 30


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No APPLIANCE_* variable of the developer's shell leaks in; `default` is a fake export under tmp_path."""
    for flag in options.SERVE_OPTIONS:
        monkeypatch.delenv(options.env_name(flag), raising=False)
    monkeypatch.setenv("APPLIANCE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    fake_export(tmp_path / "data" / "models" / "smollm2-135m-instruct" / SERVED, "SmolLM2-135M-Instruct")


def fake_export(directory: Path, name: str = "tiny", backend: str = "openvino") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    Manifest(
        name=name,
        backend=backend,
        weight_format="fp16",
        model_file="openvino_model.xml",
        architecture="LlamaForCausalLM",
        model_type="llama",
        num_layers=1,
        num_attention_heads=1,
        num_kv_heads=1,
        head_dim=8,
        hidden_size=8,
        vocab_size=32,
        max_context=64,
        kv_dtype="f32",
        stateful=True,
    ).save(directory)
    return directory


def write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def settings(*argv: str) -> ServeSettings:
    return cli._settings(cli.parse(["serve", *argv]))[0]


def refused(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        settings(*argv)
    message = str(info.value)
    assert message and not message.startswith("appliance: ") and "\n" not in message, message
    return message


def two_models(tmp_path: Path, **extra) -> Path:
    fake_export(tmp_path / "conf" / "models" / "b")
    return write(
        tmp_path / "conf" / "config.json",
        {
            "max_num_seqs": 16,
            "kv-cache-size": 1,
            **extra,
            "model_config_list": [
                {"config": {"name": "a", "base_path": "default"}},
                {"config": {"name": "b", "base_path": "models/b", "max-num-seqs": 4, "kv_cache_tokens": 4096}},
            ],
        },
    )


# ---------------------------------------------------------------- precedence


def test_flag_beats_env_beats_file_beats_default(tmp_path, monkeypatch):
    conf = write(
        tmp_path / "c.json",
        {"port": 9001, "workers": 3, "max_num_seqs": 8, "access_log": True, "request-timeout": 5},
    )
    monkeypatch.setenv("APPLIANCE_PORT", "9002")
    monkeypatch.setenv("APPLIANCE_WORKERS", "2")
    args = cli.parse(["serve", "--config", str(conf), "--port", "9003", "--no-access-log"])
    got = {f: getattr(args, f.replace("-", "_")) for f in ("port", "workers", "max-num-seqs", "access-log", "threads")}
    assert got == {"port": 9003, "workers": 2, "max-num-seqs": 8, "access-log": False, "threads": 32}
    assert {f: args.sources[f] for f in got} == {
        "port": "flag",
        "workers": "env",
        "max-num-seqs": "file",
        "access-log": "flag",  # a flag equal to... anything still beats the file
        "threads": "default",
    }
    s, engine = cli._settings(args)
    assert (s.port, s.workers, s.access_log, s.request_timeout, engine.max_num_seqs) == (9003, 2, False, 5.0, 8)
    assert s.startup_flags == {} and s.config_file == str(conf)


def test_a_flag_given_at_its_default_still_beats_the_file(tmp_path):
    conf = write(tmp_path / "c.json", {"max-num-seqs": 8})
    assert settings("--config", str(conf), "--max-num-seqs", "32").models[0].engine.max_num_seqs == 32


def test_the_config_file_from_the_environment_and_relative_paths(tmp_path, monkeypatch):
    fake_export(tmp_path / "etc" / "export", "exported-name")
    conf = write(tmp_path / "etc" / "c.json", {"model": "export", "cache_dir": "ov-cache", "served_model_name": "m"})
    monkeypatch.setenv("APPLIANCE_CONFIG", str(conf))
    s = settings()
    assert (s.model_dir, s.served_model_name) == (str(tmp_path / "etc" / "export"), "m")
    assert s.models[0].engine.cache_dir == str(tmp_path / "etc" / "ov-cache")  # the file's directory, not the cwd


def test_aliases_a_higher_level_drops_the_other(tmp_path, monkeypatch):
    """--kv-cache-size and --kv-cache-tokens are one setting: the env's tokens replace the file's size."""
    conf = write(tmp_path / "c.json", {"kv_cache_size": "512MB"})
    monkeypatch.setenv("APPLIANCE_KV_CACHE_TOKENS", "2048")
    args = cli.parse(["serve", "--config", str(conf)])
    engine = cli._settings(args)[1]
    assert (engine.kv_cache_tokens, engine.kv_cache_bytes) == (2048, None)
    assert (args.sources["kv-cache-tokens"], args.sources["kv-cache-size"]) == ("env", "default")


# ---------------------------------------------------------------- several models


def test_model_config_list_with_per_model_engine_settings(tmp_path):
    conf = two_models(tmp_path)
    s = settings("--config", str(conf), "--max-num-batched-tokens", "256", "--tool-parser", "hermes")
    a, b = s.models
    assert (a.name, a.model_dir) == ("a", str(tmp_path / "data/models/smollm2-135m-instruct" / SERVED))
    assert (b.name, b.model_dir) == ("b", str(tmp_path / "conf" / "models" / "b"))
    assert (a.engine.max_num_seqs, a.engine.kv_cache_bytes, a.engine.kv_cache_tokens) == (16, GiB, None)
    assert (b.engine.max_num_seqs, b.engine.kv_cache_bytes, b.engine.kv_cache_tokens) == (4, None, 4096)
    assert a.engine.max_num_batched_tokens == b.engine.max_num_batched_tokens == 256  # the flag reaches both
    assert a.tool_parser == b.tool_parser == "hermes" and a.created > 0
    # the single-model fields stay, from the first model, for code that knows one model
    assert (s.model_dir, s.served_model_name, s.model_created) == (a.model_dir, "a", a.created)
    assert s.startup_flags == {"max-num-batched-tokens": 256, "tool-parser": "hermes"}
    s.runtime_dir = str(tmp_path)
    s.save()
    loaded = ServeSettings.load(str(tmp_path))
    assert loaded.startup_flags == s.startup_flags and loaded.models == s.models


def test_a_model_entry_beats_the_command_line_for_that_model(tmp_path):
    conf = two_models(tmp_path)
    a, b = settings("--config", str(conf), "--max-num-seqs", "8", "--device", "GPU").models
    assert (a.engine.max_num_seqs, b.engine.max_num_seqs) == (8, 4)
    assert a.engine.device == b.engine.device == "GPU"
    data = json.loads(conf.read_text())
    data["model_config_list"][1]["config"].update(target_device="NPU", static_batch=2)
    write(conf, data)
    # an NPU model has static shapes: a KV pool size, its own or inherited, is refused as the flag would be
    assert "model 'b': --kv-cache-size/-tokens/-precision do not apply" in refused("--config", str(conf))
    del data["model_config_list"][1]["config"]["kv_cache_tokens"]
    write(conf, data)
    assert "model 'b': --kv-cache-size" in refused("--config", str(conf))  # the file's top-level 1 GB
    a, b = settings("--config", str(conf), "--kv-cache-size", "auto").models
    assert (a.engine.device, b.engine.device, b.engine.static_batch) == ("CPU", "NPU", 2)


def test_a_box_wide_cache_dir_skips_an_onnx_model_its_own_is_refused(tmp_path):
    fake_export(tmp_path / "onnx", backend="onnx")
    models = [{"config": {"name": "ov", "base_path": "default"}}, {"config": {"name": "x", "base_path": "onnx"}}]
    conf = write(tmp_path / "c.json", {"cache_dir": "ov-cache", "model_config_list": models})
    ov, onnx = settings("--config", str(conf)).models
    assert (ov.engine.cache_dir, onnx.engine.cache_dir) == (str(tmp_path / "ov-cache"), None)
    models[1]["config"]["cache_dir"] = "ov-cache"
    write(conf, {"model_config_list": models})
    assert "model 'x': --cache-dir is OpenVINO's compiled-model cache" in refused("--config", str(conf))


def test_speculation_per_model_with_ovms_names(tmp_path):
    """Each model its own speculation: OVMS's draft_models_path (a path relative to the file) and draft_device,
    or our flag names; a global prompt_lookup reaches every paged model, and a static one must opt out."""
    fake_export(tmp_path / "conf" / "models" / "draft")
    fake_export(tmp_path / "conf" / "models" / "b")
    models = [
        {"config": {"name": "a", "base_path": "default", "num_assistant_tokens": 8}},
        {"config": {"name": "b", "base_path": "models/b", "draft_models_path": "models/draft", "draft_device": "GPU"}},
    ]
    conf = write(tmp_path / "conf" / "config.json", {"max_ngram_size": 2, "model_config_list": models})
    a, b = settings("--config", str(conf)).models
    assert (a.engine.speculative(), a.engine.num_assistant_tokens, a.engine.max_ngram_size) == (None, 8, 2)
    assert (b.engine.speculative(), b.engine.draft_device) == ("draft", "GPU")
    assert b.engine.draft_model == str(tmp_path / "conf" / "models" / "draft")  # the file's directory, not the cwd
    models[1]["config"] = {"name": "b", "base_path": "models/b", "draft-model": "models/draft", "prompt_lookup": True}
    write(conf, {"model_config_list": models})
    assert "model 'b': give --prompt-lookup or --draft-model, not both" in refused("--config", str(conf))
    models[1]["config"] = {"name": "b", "base_path": "models/b", "target_device": "NPU"}
    write(conf, {"prompt_lookup": True, "model_config_list": models})
    assert "model 'b': --prompt-lookup needs paged attention" in refused("--config", str(conf))
    models[1]["config"]["prompt_lookup"] = False
    write(conf, {"prompt_lookup": True, "model_config_list": models})
    a, b = settings("--config", str(conf)).models
    assert (a.engine.speculative(), b.engine.speculative()) == ("prompt_lookup", None)


# ---------------------------------------------------------------- refusals: one line naming the file and key

GOOD = {"name": "a", "base_path": "default"}


@pytest.mark.parametrize(
    "content, words",
    [
        ({"prot": 8000}, "unknown key 'prot'"),
        ({"config": "other.json"}, "unknown key 'config'"),
        ({"port": "8000"}, "'port' must be an integer, not \"8000\""),
        ({"workers": True}, "'workers' must be an integer, not true"),
        ({"access_log": 1}, "'access_log' must be true or false, not 1"),
        ({"host": None}, "'host' must be a string, not null"),
        ({"max_num_seqs": 4, "max-num-seqs": 8}, "'max-num-seqs' is given twice"),
        ("{not json", "not JSON: Expecting property name"),
        ('{"port": 1, "port": 2}', "key 'port' appears twice in one object"),
        ("[1, 2]", "must hold a JSON object"),
        ({"model_config_list": []}, "must be a non-empty list"),
        ({"model_config_list": [GOOD]}, 'each entry is {"config"'),
        ({"model_config_list": [{"config": GOOD}, {"config": GOOD}]}, "model name 'a' appears twice"),
        ({"model_config_list": [{"config": {"base_path": "default"}}]}, "model_config_list[0]: no 'name'"),
        ({"model_config_list": [{"config": {"name": "a"}}]}, "model_config_list[0]: no 'base_path'"),
        ({"model_config_list": [{"config": {**GOOD, "name": ""}}]}, "'name' must be a non-empty string"),
        ({"model_config_list": [{"config": {**GOOD, "nireq": 4}}]}, "model_config_list[0]: unknown key 'nireq'"),
        ({"model_config_list": [{"config": {**GOOD, "port": 4}}]}, "unknown key 'port'"),
        ({"model_config_list": [{"config": {**GOOD, "device": "CPU", "target_device": "GPU"}}]}, "given twice"),
        ({"model_config_list": [{"config": {**GOOD, "max_num_seqs": "4"}}]}, "'max_num_seqs' must be an integer"),
        ({"model_config_list": [{"config": {**GOOD, "base_path": "nowhere"}}]}, "model 'a': base_path"),
        ({"model_config_list": [{"config": {**GOOD, "max_num_seqs": 0}}]}, "model 'a': --max-num-seqs must be at"),
        ({"model_config_list": [{"config": {**GOOD, "precision": "f16"}}]}, "model 'a': --precision must be"),
        ({"model_config_list": [{"config": {**GOOD, "static_batch": 2}}]}, "--static-batch applies to static"),
        ({"model_config_list": [{"config": {**GOOD, "tool_parser": "nope"}}]}, "model 'a': "),
        ({"model_config_list": [{"config": {**GOOD, "draft_models_path": "x", "draft_model": "y"}}]}, "given twice"),
        ({"model_config_list": [{"config": {**GOOD, "draft_models_path": "none"}}]}, "is not a model export"),
        ({"model_config_list": [{"config": {**GOOD, "draft_device": "GPU"}}]}, "--draft-device needs --draft-model"),
        ({"model_config_list": [{"config": {**GOOD, "num_assistant_tokens": 0}}]}, "--num-assistant-tokens must"),
        ({"prompt_lookup": "yes"}, "'prompt_lookup' must be true or false"),
        ({"model": "default", "model_config_list": [{"config": GOOD}]}, "'model' cannot go with model_config_list"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_and_key(tmp_path, content, words):
    conf = write(tmp_path / "bad.json", content)
    message = refused("--config", str(conf))
    assert words in message and str(conf) in message, message


def test_missing_file_and_model_flags_with_a_model_list(tmp_path, monkeypatch):
    assert refused("--config", str(tmp_path / "none.json")).endswith("none.json: no such config file")
    conf = two_models(tmp_path)
    assert "--model cannot go with" in refused("--config", str(conf), "--model", "default")
    monkeypatch.setenv("APPLIANCE_SERVED_MODEL_NAME", "x")
    assert "--served-model-name cannot go with" in refused("--config", str(conf), "--served-model-name", "y")


def test_the_model_list_wins_over_a_model_from_the_environment(tmp_path, monkeypatch):
    """The systemd env file's APPLIANCE_MODEL=default and APPLIANCE_CONFIG with a model list: the list is served,
    with an info line saying the variable was not used (on the command line the two stay an error, above)."""
    conf = two_models(tmp_path)
    monkeypatch.setenv("APPLIANCE_MODEL", "default")
    monkeypatch.setenv("APPLIANCE_SERVED_MODEL_NAME", "x")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("appliance.serve")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not the attribute: it clears the logger's cached isEnabledFor answers
    try:
        served = settings("--config", str(conf))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [m.name for m in served.models] == ["a", "b"]
    line = next(r for r in records if "model_config_list" in r.getMessage())
    assert line.levelname == "INFO" and line.ignored == ["APPLIANCE_MODEL", "APPLIANCE_SERVED_MODEL_NAME"]


# ---------------------------------------------------------------- appliance config


def test_appliance_config_prints_values_sources_and_models(tmp_path, monkeypatch, capsys):
    conf = two_models(tmp_path)
    monkeypatch.setenv("APPLIANCE_WORKERS", "3")
    assert cli.main(["config", "--config", str(conf), "--max-num-batched-tokens", "128"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config_file"] == str(conf) and set(out["settings"]) == set(out["sources"]) == set(options.SERVE_OPTIONS)
    assert (out["settings"]["workers"], out["settings"]["max-num-seqs"], out["settings"]["port"]) == (3, 16, 8000)
    assert {k: out["sources"][k] for k in ("workers", "max-num-seqs", "max-num-batched-tokens", "port")} == {
        "workers": "env",
        "max-num-seqs": "file",
        "max-num-batched-tokens": "flag",
        "port": "default",
    }
    a, b = out["models"]
    assert (a["name"], a["engine"]["max_num_seqs"], b["name"], b["engine"]["max_num_seqs"]) == ("a", 16, "b", 4)
    assert (a["sources"]["max-num-seqs"], b["sources"]["max-num-seqs"]) == ("file", "model")
    assert (b["sources"]["kv-cache-tokens"], b["sources"]["kv-cache-size"], b["sources"]["device"]) == (
        "model",
        "model",
        "default",
    )
    assert b["engine"]["max_num_batched_tokens"] == 128 and b["sources"]["max-num-batched-tokens"] == "flag"


def test_config_takes_the_flags_of_serve(monkeypatch):
    monkeypatch.setenv("APPLIANCE_THREADS", "7")
    flags = ["--port", "9", "--no-enable-prefix-caching", "--kv-cache-size", "2GB"]
    serve, config = (vars(cli.build_parser().parse_args([command, *flags])) for command in ("serve", "config"))
    assert serve.pop("command") == "serve" and config.pop("command") == "config"
    assert (
        serve == config and serve["threads"] == 7 and set(serve) == {f.replace("-", "_") for f in options.SERVE_OPTIONS}
    )


def test_appliance_config_of_one_model_and_its_errors(capsys):
    assert cli.main(["config", "--max-num-seqs", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in out["models"]] == ["SmolLM2-135M-Instruct"]
    assert out["models"][0]["sources"]["max-num-seqs"] == "flag" and out["config_file"] is None
    assert cli.main(["config", "--max-num-seqs", "0"]) == 78  # EX_CONFIG, one line on stderr
    assert capsys.readouterr().err == "appliance: --max-num-seqs must be at least 1\n"


# ---------------------------------------------------------------- reload_models


def test_reload_adds_and_removes_models_keeping_the_start_up_flags(tmp_path):
    conf = two_models(tmp_path)
    s = settings("--config", str(conf), "--max-num-seqs", "8")
    assert [(m.name, m.engine.max_num_seqs) for m in s.models] == [("a", 8), ("b", 4)]
    fake_export(tmp_path / "conf" / "models" / "c")
    data = json.loads(conf.read_text())
    data["max_num_seqs"] = 2  # the command line's 8 still wins
    data["kv-cache-size"] = 2  # the file's top level changes what the models inherit
    data["model_config_list"].append({"config": {"name": "c", "base_path": "models/c", "max_num_seqs": 1}})
    write(conf, data)
    added = config_file.reload_models(s)
    assert [(m.name, m.engine.max_num_seqs, m.engine.kv_cache_bytes) for m in added] == [
        ("a", 8, 2 * GiB),
        ("b", 4, None),
        ("c", 1, 2 * GiB),
    ]
    data["model_config_list"] = data["model_config_list"][1:2]
    write(conf, data)
    assert [m.name for m in config_file.reload_models(s)] == ["b"]


@pytest.mark.parametrize(
    "breakage, words",
    [
        (lambda d: d["model_config_list"].append({"config": {"name": "a", "base_path": "default"}}), "twice"),
        (lambda d: d["model_config_list"][1]["config"].update(base_path="models/gone"), "model 'b': base_path"),
        (lambda d: d.update(prot=1), "unknown key 'prot'"),
        (lambda d: d["model_config_list"][0]["config"].update(max_num_seqs=-1), "--max-num-seqs must be at least 1"),
        (lambda d: d.pop("model_config_list"), "no model_config_list to reload"),
    ],
)
def test_reload_refuses_a_broken_file_in_one_line(tmp_path, breakage, words):
    conf = two_models(tmp_path)
    s = settings("--config", str(conf))
    data = json.loads(conf.read_text())
    breakage(data)
    write(conf, data)
    with pytest.raises(ValueError) as info:
        config_file.reload_models(s)
    assert words in str(info.value) and "\n" not in str(info.value) and str(conf) in str(info.value)
    conf.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        config_file.reload_models(s)


def test_reload_without_a_config_file():
    with pytest.raises(ValueError, match="started without --config"):
        config_file.reload_models(settings())


def test_the_reload_path_loads_neither_numpy_nor_openvino():
    code = (
        "import sys, appliance.server.config_file; print(sorted(m for m in ('numpy', 'openvino') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


# ---------------------------------------------------------------- docs/deploy.md's example is a working file


def test_the_documented_config_file_parses(tmp_path):
    doc = (ROOT / "docs" / "deploy.md").read_text()
    section = doc[doc.index("## Configuration") :]
    example = json.loads(re.search(r"```json\n(.*?)```", section, re.S)[1])
    for entry in example["model_config_list"]:
        if entry["config"]["base_path"] != "default":
            fake_export(tmp_path / "etc" / entry["config"]["base_path"])
    conf = write(tmp_path / "etc" / "config.json", example)
    s = settings("--config", str(conf), "--max-num-seqs", "8")
    smol, qwen = s.models
    assert (s.workers, smol.name, qwen.name, qwen.tool_parser) == (2, "SmolLM2-135M-Instruct", "qwen2.5-0.5b", "hermes")
    # what the document says of this example
    assert (smol.engine.max_num_seqs, smol.engine.kv_cache_bytes) == (8, GiB)
    assert (qwen.engine.max_num_seqs, qwen.engine.kv_cache_tokens, qwen.engine.kv_cache_bytes) == (4, 16384, None)
    assert "<!-- multi-model helper -->" in section


def test_encoder_priority_is_a_serve_option(monkeypatch):
    """The embedding forwards' thread priority behind chat: --encoder-nice / --encoder-sched, or their variables
    (what bench.embeddings_http sets on the server it starts), reach the settings the supervisor loads encoder
    models with; values the thread could not take are refused before anything loads."""
    assert (settings().encoder_nice, settings().encoder_sched) == (19, "idle")
    monkeypatch.setenv("APPLIANCE_ENCODER_NICE", "5")
    monkeypatch.setenv("APPLIANCE_ENCODER_SCHED", "normal")
    assert (settings().encoder_nice, settings().encoder_sched) == (5, "normal")
    assert settings("--encoder-nice", "0").encoder_nice == 0
    assert "--encoder-nice" in refused("--encoder-nice", "20")
    assert "--encoder-sched" in refused("--encoder-sched", "fifo")


def test_keep_alive_and_the_models_memory_budget(tmp_path):
    """--keep-alive is every model's default, a config entry's `keep_alive` (a number is seconds) its own; the
    budget and both durations are checked before anything loads."""
    conf = write(
        tmp_path / "k.json",
        {
            "keep_alive": "5m",
            "models_memory_budget": "2GiB",
            "model_config_list": [
                {"config": {"name": "a", "base_path": "default"}},
                {"config": {"name": "b", "base_path": "default", "keep_alive": 30}},
            ],
        },
    )
    s = settings("--config", str(conf))
    assert (s.keep_alive, s.models_memory_budget) == ("5m", "2GiB")
    assert [m.keep_alive for m in s.models] == ["5m", "30"]
    assert settings("--config", str(conf), "--keep-alive", "-1").models[0].keep_alive == "-1"  # the flag wins
    assert settings().keep_alive == "-1" and settings().models[0].keep_alive is None  # forever, as before
    assert "--keep-alive" in refused("--keep-alive", "soon")
    assert "--models-memory-budget" in refused("--models-memory-budget", "lots")
    assert "--models-load-wait" in refused("--models-load-wait", "0")
    bad = write(
        tmp_path / "bad.json",
        {"model_config_list": [{"config": {"name": "a", "base_path": "default", "keep_alive": "5 minutes"}}]},
    )
    assert "'a'" in refused("--config", str(bad)) and "keep_alive" in refused("--config", str(bad))
