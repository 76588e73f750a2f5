"""Settings from defaults, environment, env file and init kwargs; validation, masking; the CLI's flags."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError
from pydantic_settings import SettingsError

from gateway.cli import build_parser, load_settings, main
from gateway.settings import (
    DEFAULT_SYSTEM_MESSAGE,
    RedisSettings,
    RelaySettings,
    Settings,
    masked_redis_url,
    parse_redis_url,
    unknown_variables,
)

pytestmark = pytest.mark.timeout(5)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No NEMOTRON_* variable of the machine running the tests leaks into them."""
    for name in list(os.environ):
        if name.upper().startswith("NEMOTRON_"):
            monkeypatch.delenv(name)


def write_env_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.env"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = Settings()
    assert (s.host, s.port) == ("127.0.0.1", 8000)
    assert s.engine_url == "http://127.0.0.1:8001"
    assert s.engine_api_key is None
    assert s.redis_url.get_secret_value() == "redis://127.0.0.1:6379/0"
    assert s.model_name is None and s.context_length is None
    assert s.model_aliases == ()
    assert s.default_system_message == DEFAULT_SYSTEM_MESSAGE
    assert s.inject_system_message is True
    assert s.max_n == 8
    assert s.log_level == "info"
    assert s.relay == RelaySettings()
    assert s.relay.chunk_timeout == 120.0 and s.relay.heartbeat_interval == 15.0
    assert s.redis == RedisSettings()


def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEMOTRON_ENGINE_URL", "http://10.0.0.5:9000")
    monkeypatch.setenv("NEMOTRON_PORT", "9100")
    monkeypatch.setenv("NEMOTRON_RELAY__CHUNK_TIMEOUT", "42.5")
    monkeypatch.setenv("NEMOTRON_MODEL_ALIASES", '["a","b"]')
    monkeypatch.setenv("NEMOTRON_ENGINE_API_KEY", "engine-token")
    s = Settings()
    assert s.engine_url == "http://10.0.0.5:9000"
    assert s.port == 9100
    assert s.relay.chunk_timeout == 42.5
    assert s.relay.heartbeat_interval == RelaySettings().heartbeat_interval  # the rest of the group stays default
    assert s.model_aliases == ("a", "b")
    assert s.engine_api_key is not None and s.engine_api_key.get_secret_value() == "engine-token"


def test_env_file(tmp_path: Path) -> None:
    path = write_env_file(
        tmp_path,
        "NEMOTRON_PORT=9200\nNEMOTRON_MODEL_NAME=nemotron-nano\nNEMOTRON_RELAY__HEARTBEAT_INTERVAL=3\n",
    )
    s = Settings(_env_file=path)
    assert s.port == 9200
    assert s.model_name == "nemotron-nano"
    assert s.relay.heartbeat_interval == 3.0


def test_precedence_init_over_env_over_env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_env_file(tmp_path, "NEMOTRON_PORT=9200\nNEMOTRON_HOST=0.0.0.0\nNEMOTRON_MAX_N=3\n")
    monkeypatch.setenv("NEMOTRON_PORT", "9300")
    monkeypatch.setenv("NEMOTRON_HOST", "10.1.1.1")
    s = Settings(_env_file=path, port=9400)
    assert s.port == 9400  # init kwarg beats env and file
    assert s.host == "10.1.1.1"  # env beats file
    assert s.max_n == 3  # file beats default


@pytest.mark.parametrize(
    ("env", "value", "loc"),
    [
        ("NEMOTRON_PORT", "0", "port"),
        ("NEMOTRON_PORT", "65536", "port"),
        ("NEMOTRON_PORT", "eighty", "port"),
        ("NEMOTRON_ENGINE_URL", "127.0.0.1:8001", "engine_url"),
        ("NEMOTRON_ENGINE_URL", "ftp://127.0.0.1:8001", "engine_url"),
        ("NEMOTRON_RELAY__CHUNK_TIMEOUT", "0", "relay.chunk_timeout"),
        ("NEMOTRON_MAX_N", "0", "max_n"),
        ("NEMOTRON_LOG_LEVEL", "verbose", "log_level"),
        ("NEMOTRON_RELAY__CHUNK_TIMOUT", "5", "relay.chunk_timout"),
    ],
)
def test_invalid_environment_fails_at_startup(monkeypatch: pytest.MonkeyPatch, env: str, value: str, loc: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert loc in {".".join(str(p) for p in e["loc"]) for e in caught.value.errors()}


@pytest.mark.parametrize(
    ("kwargs", "loc"),
    [
        ({"port": 0}, "port"),
        ({"engine_url": "localhost:8001"}, "engine_url"),
        ({"portt": 8000}, "portt"),
        ({"relay": {"chunk_timeout": -1}}, "relay.chunk_timeout"),
        ({"relay": {"typo": 1}}, "relay.typo"),
    ],
)
def test_invalid_init_values(kwargs: dict[str, object], loc: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(**kwargs)  # type: ignore[arg-type]  # deliberately wrong values
    assert loc in {".".join(str(p) for p in e["loc"]) for e in caught.value.errors()}


def test_model_aliases_must_be_a_json_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEMOTRON_MODEL_ALIASES", "a,b")
    with pytest.raises(SettingsError, match="model_aliases"):
        Settings()


def test_unknown_setting_in_env_file_is_rejected(tmp_path: Path) -> None:
    # extra="forbid": a misspelt key in the env file fails at startup instead of being ignored.
    path = write_env_file(tmp_path, "NEMOTRON_PORTT=9000\n")
    with pytest.raises(ValidationError, match=r"(?i)nemotron_portt"):
        Settings(_env_file=path)


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("http://127.0.0.1:8001/", "http://127.0.0.1:8001"),
        ("https://engine.internal///", "https://engine.internal"),
        ("http://127.0.0.1:8001", "http://127.0.0.1:8001"),
    ],
)
def test_engine_url_trailing_slash_is_stripped(given: str, stored: str) -> None:
    assert Settings(engine_url=given).engine_url == stored


def test_masked_never_shows_secrets() -> None:
    s = Settings(
        redis_url=SecretStr("redis://:s3cret@host:6379/0"),
        engine_api_key=SecretStr("engine-k3y"),
        auth={"secret": "hmac-pepper"},
    )
    masked = s.masked()
    text = json.dumps(masked)
    for secret in ("s3cret", "engine-k3y", "hmac-pepper"):
        assert secret not in text
    # Still a useful log line: the rest is there.
    assert masked["engine_url"] == "http://127.0.0.1:8001"
    assert masked["relay"]["chunk_timeout"] == 120.0
    assert "redis_url" in masked and "engine_api_key" in masked


def test_secrets_do_not_leak_through_repr() -> None:
    s = Settings(redis_url=SecretStr("redis://:s3cret@host:6379/0"), engine_api_key=SecretStr("engine-k3y"))
    assert "s3cret" not in repr(s) and "engine-k3y" not in repr(s)
    assert "s3cret" not in str(s)


def test_settings_are_frozen() -> None:
    s = Settings()
    with pytest.raises(ValidationError):
        s.port = 9000  # type: ignore[misc]  # frozen model
    with pytest.raises(ValidationError):
        s.relay.chunk_timeout = 1.0  # type: ignore[misc]  # frozen group
    assert s.port == 8000 and s.relay.chunk_timeout == 120.0


def test_cli_parses_serve_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "--host", "0.0.0.0", "--port", "9001", "--engine-url", "http://e:1", "--redis-url", "redis://r:1/2"]
    )
    assert args.verb == "serve"
    assert (args.host, args.port, args.engine_url, args.redis_url) == ("0.0.0.0", 9001, "http://e:1", "redis://r:1/2")


def test_cli_flags_beat_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEMOTRON_HOST", "10.0.0.1")
    monkeypatch.setenv("NEMOTRON_PORT", "9500")
    monkeypatch.setenv("NEMOTRON_ENGINE_URL", "http://from-env:1")
    monkeypatch.setenv("NEMOTRON_REDIS_URL", "redis://from-env:6379/0")
    monkeypatch.setenv("NEMOTRON_MAX_N", "2")
    args = build_parser().parse_args(
        [
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            "9001",
            "--engine-url",
            "http://flag:1/",
            "--redis-url",
            "redis://flag/3",
        ]
    )
    s = load_settings(args)
    assert (s.host, s.port, s.engine_url) == ("0.0.0.0", 9001, "http://flag:1")
    assert s.redis_url.get_secret_value() == "redis://flag/3"
    assert s.max_n == 2  # no flag: the environment still applies


def test_cli_without_flags_uses_environment_and_env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEMOTRON_PORT", "9600")
    path = write_env_file(tmp_path, "NEMOTRON_ENGINE_URL=http://from-file:2\nNEMOTRON_PORT=1\n")
    s = load_settings(build_parser().parse_args(["serve", "--env-file", str(path)]))
    assert s.port == 9600
    assert s.engine_url == "http://from-file:2"


def test_cli_invalid_flag_value_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="engine_url"):
        load_settings(build_parser().parse_args(["serve", "--engine-url", "no-scheme:1"]))


@pytest.mark.parametrize(
    ("env", "value"),
    [("NEMOTRON_PORT", "0"), ("NEMOTRON_ENGINE_URL", "no-scheme:1"), ("NEMOTRON_MODEL_ALIASES", "a,b")],
)
def test_cli_reports_invalid_configuration_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: str, value: str
) -> None:
    monkeypatch.setenv(env, value)
    assert main(["serve"]) == 2
    assert "invalid configuration" in capsys.readouterr().err


def test_engine_probe_interval_is_the_deprecated_name_of_health_interval(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # RelaySettings.probe_interval (the gateway's /health poll) keeps its name; the engine's was renamed.
    monkeypatch.setenv("NEMOTRON_ENGINE__PROBE_INTERVAL", "7")
    with caplog.at_level("WARNING", logger="gateway.settings"):
        settings = Settings()
    assert settings.engine.health_interval == 7.0
    assert "use NEMOTRON_ENGINE__HEALTH_INTERVAL" in caplog.text
    assert Settings(engine={"health_interval": 3}).engine.health_interval == 3.0


def test_unknown_variables_name_the_closest_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEMOTRON_REDIS_ULR", "redis://x")
    monkeypatch.setenv("NEMOTRON_PORT", "9000")  # a setting: no warning
    monkeypatch.setenv("NEMOTRON_TEST_REDIS_URL", "redis://y")  # the test suite's own: no warning
    env_file = write_env_file(tmp_path, "# comment\nexport NEMOTRON_RELAY__CHUNK_TIMOUT=3\nNEMOTRON_HOST=0.0.0.0\n")
    warnings = unknown_variables(env_file)
    assert len(warnings) == 2, warnings
    assert "NEMOTRON_REDIS_ULR (in the environment) is not a setting; did you mean NEMOTRON_REDIS_URL?" in warnings
    assert any("NEMOTRON_RELAY__CHUNK_TIMOUT" in w and "NEMOTRON_RELAY__CHUNK_TIMEOUT?" in w for w in warnings)


def test_a_sentinel_url_is_read_into_its_parts() -> None:
    address = parse_redis_url("redis+sentinel://user:p%40ss@h1:26380,h2,[::1]:26381/my%20master/4")
    assert address is not None
    assert address.sentinels == (("h1", 26380), ("h2", 26379), ("::1", 26381))
    assert (address.service, address.db, address.username) == ("my master", 4, "user")
    assert address.password is not None and address.password.get_secret_value() == "p@ss"
    assert "p@ss" not in repr(address)
    plain = parse_redis_url("redis+sentinel://h1/mymaster")
    assert plain is not None and (plain.db, plain.password, plain.username) == (0, None, None)
    assert parse_redis_url("redis://:pw@host:6379/0") is None  # redis-py reads every other URL


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://:hunter2@h1:26379", "names the master"),
        ("redis+sentinel://:hunter2@h1:26379/", "names the master"),
        ("redis+sentinel://:hunter2@h1:notaport/m", "bad port for Sentinel h1"),
        ("redis+sentinel://:hunter2@h1:70000/m", "bad port"),
        ("redis+sentinel://:hunter2@h1,,h2/m", "one is empty"),
        ("redis+sentinel://:hunter2@[::1/m", "IPv6"),
        ("redis+sentinel://:hunter2@h1/m/x", "/<master name>[/<db number>]"),
        ("redis+sentinel://:hunter2@h1/m/0/extra", "/<master name>[/<db number>]"),
        ("redis+sentinel://:hunter2@h1/m/0?password=x", "no query"),
    ],
)
def test_a_bad_sentinel_url_fails_at_startup_without_quoting_the_password(
    url: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEMOTRON_REDIS_URL", url)  # as a unit's env file gives it: a plain string
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert says in str(caught.value)
    assert "hunter2" not in str(caught.value)


def test_masked_redis_url_hides_the_password_of_either_form() -> None:
    assert masked_redis_url("redis+sentinel://:pw@h1:26379,h2/m/0") == "redis+sentinel://:***@h1:26379,h2/m/0"
    assert masked_redis_url("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"
    assert masked_redis_url("redis://host:6379/0") == "redis://host:6379/0"
