"""The supervisor's TOML config: locations, decoding errors, overrides; and no mlx import."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.supervisor.config import (
    Config,
    ConfigError,
    ModelConfig,
    PoolConfig,
    ServerConfig,
    apply_overrides,
    config_path,
    is_explicit_config,
    load_config,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def load_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), explicit=True)
    return str(info.value)


def test_defaults() -> None:
    server = Config().server
    assert (server.host, server.port, server.api_keys, server.admin_keys) == (
        "127.0.0.1",
        8800,
        [],
        [],
    )
    assert server.max_body_bytes == 32 * 1024 * 1024
    assert server.insecure_no_auth is False
    assert Config().models == {}


def test_full_file(tmp_path: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            """
            [server]
            host = "0.0.0.0"
            port = 9000
            api_keys = ["k1", "k2"]
            admin_keys = ["a1"]
            max_body_bytes = 1024
            insecure_no_auth = true

            [models.qwen]
            path = "/models/qwen"
            pin = true
            max_context = 8192

            [models."org/name"]
            path = "/models/other"
            """,
        ),
        explicit=True,
    )
    assert cfg.server == ServerConfig(
        host="0.0.0.0", port=9000, api_keys=["k1", "k2"], admin_keys=["a1"],
        max_body_bytes=1024, insecure_no_auth=True,
    )  # fmt: skip
    assert cfg.models["qwen"] == ModelConfig(path="/models/qwen", pin=True, max_context=8192)
    assert cfg.models["org/name"].pin is False and cfg.models["org/name"].max_context is None


def test_batch_width_keys(tmp_path: Path) -> None:
    assert PoolConfig().batch == "auto"
    assert ModelConfig(path="a").batch is None  # the pool's width
    text = '[pool]\nbatch = 256\n[models.a]\npath = "a"\nbatch = 1\n[models.b]\npath = "b"\n'
    cfg = load_config(write(tmp_path, text), explicit=True)
    assert (cfg.pool.batch, cfg.models["a"].batch, cfg.models["b"].batch) == (256, 1, None)
    text = '[pool]\nbatch = 16\n[models.a]\npath = "a"\nbatch = "auto"\n'
    assert load_config(write(tmp_path, '[server.key_priorities]\nagent = 10\n'), explicit=True).server.key_priorities == {
        "agent": 10}
    cfg = load_config(write(tmp_path, text), explicit=True)
    assert (cfg.pool.batch, cfg.models["a"].batch) == (16, "auto")


def test_engine_warmup_and_gather_keys(tmp_path: Path) -> None:
    assert (PoolConfig().warmup, PoolConfig().gather_ms) == ("auto", 5.0)
    cfg = load_config(write(tmp_path, '[pool]\nwarmup = "off"\ngather_ms = 0\n'), explicit=True)
    assert (cfg.pool.warmup, cfg.pool.gather_ms) == ("off", 0.0)
    assert "warmup" in load_error(tmp_path, '[pool]\nwarmup = "sometimes"\n')
    assert "gather_ms" in load_error(tmp_path, "[pool]\ngather_ms = -1\n")
    assert "gather_ms" in load_error(tmp_path, "[pool]\ngather_ms = 5000\n")


def test_model_paths_expand_home_and_are_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    text = '[models.a]\npath = "~/m/a"\n[models.b]\npath = "rel/b"\n'
    cfg = load_config(write(tmp_path, text), explicit=True)
    assert cfg.models["a"].path == str(tmp_path / "home" / "m" / "a")
    assert cfg.models["b"].path == str(tmp_path / "rel" / "b")
    assert ModelConfig(path="~/x").resolved_path() == tmp_path / "home" / "x"


def test_missing_file_is_defaults_unless_explicit(tmp_path: Path) -> None:
    assert load_config(tmp_path / "nope.toml", explicit=False) == Config()
    with pytest.raises(ConfigError, match=r"nope\.toml: config file not found"):
        load_config(tmp_path / "nope.toml", explicit=True)


def test_unreadable_path_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file"):
        load_config(tmp_path, explicit=False)


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[server]\nprot = 1\n")
    assert message.startswith(f"{tmp_path / 'config.toml'}: ")
    assert "unknown key 'server.prot'" in message
    assert "did you mean 'server.port'?" in message


def test_unknown_top_level_and_model_keys(tmp_path: Path) -> None:
    assert "unknown key 'model' (did you mean 'models'?)" in load_error(
        tmp_path, "[model.x]\npath='a'\n"
    )
    message = load_error(tmp_path, '[models.qwen]\npath = "a"\npinned = true\n')
    assert "unknown key 'models.qwen.pinned' (did you mean 'models.qwen.pin'?)" in message
    assert "unknown key 'models.\"a.b\".x'" in load_error(
        tmp_path, '[models."a.b"]\npath = "a"\nx = 1\n'
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[server]\nport = "80"\n', "server.port: expected `int`, got `str`"),
        ("[server]\nport = 70000\n", "server.port: expected `int` <= 65535"),
        ("[server]\nport = 0\n", "server.port: expected `int` >= 1"),
        ('[server]\napi_keys = ["ok", ""]\n', "server.api_keys[1]: expected `str` of length >= 1"),
        ('[server]\napi_keys = "k"\n', "server.api_keys: expected `array`, got `str`"),
        ("[server]\nadmin_keys = [1]\n", "server.admin_keys[0]: expected `str`, got `int`"),
        ("[server]\ninsecure_no_auth = 1\n", "server.insecure_no_auth: expected `bool`, got `int`"),
        ("[models.qwen]\npin = true\n", "models.qwen: object missing required field `path`"),
        (
            '[models.qwen]\npath = "a"\nmax_context = 0\n',
            "models.qwen.max_context: expected `int` >= 1",
        ),
        ("[pool]\nbatch = 0\n", "pool.batch: expected `int` >= 1"),
        ("[pool]\nbatch = 257\n", "pool.batch: expected `int` <= 256"),
        ('[server]\nkey_priorities = {agent = "ten"}\n', "server.key_priorities[...]: expected `int`, got `str`"),
        ('[server]\nkey_priorities = {agent = 3000000000}\n', "server.key_priorities[...]: expected `int` <= 2147483647"),
        ('[pool]\nbatch = "8"\n', 'pool.batch: expected a width from 1 to 256, or "auto" (invalid enum value \'8\')'),
        ("[pool]\nbatch = 8.0\n", 'pool.batch: expected a width from 1 to 256, or "auto", got `float`'),
        ('[models.qwen]\npath = "a"\nbatch = 0\n', "models.qwen.batch: expected `int` >= 1"),
        ('[models.qwen]\npath = "a"\nbatch = 257\n', "models.qwen.batch: expected `int` <= 256"),
        ('[models.qwen]\npath = "a"\nbatch = "8"\n',
         'models.qwen.batch: expected a width from 1 to 256, or "auto" (invalid enum value \'8\')'),
        ('[models.qwen]\npath = "a"\nbatch = 8.0\n', 'models.qwen.batch: expected a width from 1 to 256, or "auto", got `float`'),
        ("[defaults]\ntemperature = 3\n", "defaults.temperature: expected `float` <= 2.0"),
        ("[defaults]\nmax_tokens = 0\n", "defaults.max_tokens: expected `int` >= 1"),
        ("[defaults]\nseed = 1\n", "unknown key 'defaults.seed'"),
        ('[models.qwen]\npath = "a"\n[models.qwen.defaults]\nthinking = "no"\n',
         "models.qwen.defaults.thinking: expected `bool | null`, got `str`"),
        ("models = 3\n", "models: expected `object`, got `int`"),
        ("server = 3\n", "server: expected `object`, got `int`"),
    ],
)
def test_wrong_types_name_the_key(tmp_path: Path, text: str, expected: str) -> None:
    message = load_error(tmp_path, text)
    assert message == f"{tmp_path / 'config.toml'}: {expected}"


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    message = load_error(tmp_path, '[server]\nhost = "a"\nport = \n')
    assert message.startswith(f"{tmp_path / 'config.toml'}: line 3, column 8: ")
    assert "invalid TOML" in load_error(tmp_path, 'x = "abc')


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b'x = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path, explicit=True)


def test_config_path_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert config_path(None, env={}) == tmp_path / ".config" / "mlxd" / "config.toml"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert config_path(None, env={}) == tmp_path / "xdg" / "mlxd" / "config.toml"
    assert config_path(None, env={"MLXD_CONFIG": "/e.toml"}) == Path("/e.toml")
    assert config_path("/c.toml", env={"MLXD_CONFIG": "/e.toml"}) == Path("/c.toml")
    assert config_path("~/c.toml", env={}) == tmp_path / "c.toml"
    assert not is_explicit_config(None, env={})
    assert is_explicit_config(None, env={"MLXD_CONFIG": "/e.toml"})
    assert is_explicit_config("/c.toml", env={})


def test_config_path_on_macos(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = tmp_path / "Library" / "Application Support" / "mlxd" / "config.toml"
    assert config_path(None, env={}) == expected


def test_overrides_cli_beats_env_beats_file() -> None:
    cfg = Config(server=ServerConfig(host="10.0.0.1", port=9000))
    assert apply_overrides(cfg, env={}).server.port == 9000
    env = {"MLXD_HOST": "0.0.0.0", "MLXD_PORT": "9100"}
    server = apply_overrides(cfg, env=env).server
    assert (server.host, server.port) == ("0.0.0.0", 9100)
    server = apply_overrides(cfg, host="::1", port=9200, env=env).server
    assert (server.host, server.port) == ("::1", 9200)
    assert cfg.server.port == 9000  # the input is untouched


def test_env_api_key_adds_one_key() -> None:
    cfg = Config(server=ServerConfig(api_keys=["file-key"]))
    assert apply_overrides(cfg, env={"MLXD_API_KEY": "env-key"}).server.api_keys == [
        "file-key",
        "env-key",
    ]
    assert apply_overrides(cfg, env={"MLXD_API_KEY": "file-key"}).server.api_keys == ["file-key"]
    assert apply_overrides(cfg, env={"MLXD_API_KEY": ""}).server.api_keys == ["file-key"]


def test_insecure_flag_override() -> None:
    assert apply_overrides(Config(), insecure_no_auth=True, env={}).server.insecure_no_auth
    assert not apply_overrides(Config(), env={}).server.insecure_no_auth


@pytest.mark.parametrize(
    ("value", "match"), [("http", "MLXD_PORT: not a port"), ("0", "MLXD_PORT: port 0")]
)
def test_bad_env_port(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        apply_overrides(Config(), env={"MLXD_PORT": value})


def test_bad_cli_port() -> None:
    with pytest.raises(ConfigError, match=r"--port: port 65536 is out of range"):
        apply_overrides(Config(), port=65536, env={})


def test_supervisor_modules_do_not_import_mlx() -> None:
    code = (
        "import sys\n"
        "import mlxd.supervisor.config, mlxd.supervisor.registry, mlxd.supervisor.http.auth\n"
        "banned = ('mlx', 'mlx_lm', 'transformers', 'huggingface_hub')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


# --- a config file holding keys that others can read -------------------------------


def keyed(tmp_path: Path, mode: int, text: str = '[server]\napi_keys = ["k"]\n', name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


def warnings_for(path: Path, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlxd.config"):
        load_config(path, explicit=True)
    return [r.getMessage() for r in caplog.records if r.name == "mlxd.config"]


def test_keys_readable_by_others_are_warned_about_naming_the_file_mode_and_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = keyed(tmp_path, 0o644)
    assert warnings_for(path, caplog) == [
        f"{path} holds API keys and is readable by others (mode 644); run chmod 600 {path}"
    ]
    admin = keyed(tmp_path, 0o640, '[server]\nadmin_keys = ["a"]\n', "my config.toml")
    assert warnings_for(admin, caplog) == [
        f"{admin} holds API keys and is readable by others (mode 640); run chmod 600 '{admin}'"
    ]


@pytest.mark.parametrize(
    ("mode", "text"),
    [(0o600, '[server]\napi_keys = ["k"]\n'), (0o400, '[server]\nadmin_keys = ["a"]\n'),
     (0o644, '[server]\nport = 9000\n'), (0o644, "[server]\napi_keys = []\n")],
)
def test_no_warning_for_a_private_file_or_one_without_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, text: str
) -> None:
    assert warnings_for(keyed(tmp_path, mode, text), caplog) == []


@pytest.mark.parametrize(("line", "field"), [
    ("prompt_cache_bytes = -1", "prompt_cache_bytes"), ("ssd_cache_bytes = -1", "ssd_cache_bytes"),
    ("kv_bits = 7", "kv_bits"), ("kv_group_size = 48", "kv_group_size"), ('ssd_write_behind = "yes"', "ssd_write_behind"),
    ('cuda_graphs = "on"', "cuda_graphs"), ("generation_checkpoint = -1", "generation_checkpoint"),
    ('generation_checkpoint = "often"', "generation_checkpoint"),
])
def test_bad_prompt_cache_keys_name_the_field(tmp_path: Path, line: str, field: str) -> None:
    assert f"pool.{field}" in load_error(tmp_path, f"[pool]\n{line}\n")


def test_generation_checkpoint_reaches_the_engines_only_when_not_the_default() -> None:
    from mlxd.supervisor.config import PoolConfig
    from mlxd.supervisor.engines.pool import engine_args_from

    assert "--generation-checkpoint" not in engine_args_from(PoolConfig())
    args = engine_args_from(PoolConfig(generation_checkpoint=0))
    assert args[args.index("--generation-checkpoint") + 1] == "0"


def test_a_model_served_by_an_engine_group_is_configured_and_checked(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[models.big]\npath = "/m"\ndistributed = {ranks = 2, backend = "nccl"}\n'),
                      explicit=True)
    group = cfg.models["big"].distributed
    assert group is not None and (group.ranks, group.backend, group.mode) == (2, "nccl", "tensor")
    assert "names one host a rank: 1 hosts for 2 ranks" in load_error(
        tmp_path, '[models.big]\npath = "/m"\ndistributed = {ranks = 2, hosts = ["10.0.0.2"]}\n')
    assert "this machine's own IP address, no port" in load_error(
        tmp_path, '[models.big]\npath = "/m"\ndistributed = {ranks = 2, hosts = ["10.0.0.1:80", "10.0.0.2"]}\n')
    two = load_config(write(tmp_path, '[models.big]\npath = "/m"\n'
                                      'distributed = {ranks = 2, hosts = ["10.0.0.1", "10.0.0.2:9000"]}\n'), explicit=True)
    assert "IP addresses" in load_error(
        tmp_path, '[models.big]\npath = "/m"\ndistributed = {ranks = 2, hosts = ["10.0.0.1", "mac-b.local"]}\n')
    assert "NCCL backend has no send and receive" in load_error(
        tmp_path, '[models.big]\npath = "/m"\ndistributed = {ranks = 2, backend = "nccl", mode = "pipeline"}\n')
    spread = two.models["big"].distributed
    assert spread is not None and spread.hosts == ["10.0.0.1", "10.0.0.2:9000"]
    assert "ranks" in load_error(tmp_path, '[models.big]\npath = "/m"\ndistributed = {ranks = 1}\n')
    assert "backend" in load_error(tmp_path, '[models.big]\npath = "/m"\ndistributed = {ranks = 2, backend = "mpi"}\n')
