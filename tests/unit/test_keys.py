"""API key format, hashing, records and the `keys` CLI's argument parsing (no sockets)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import SecretStr

from gateway.auth.cli import add_keys_parser, parse_duration
from gateway.auth.keys import (
    ApiKey,
    KeyHasher,
    KeyLimits,
    KeyState,
    check_model,
    display_prefix,
    generate_secret,
    looks_like_secret,
    validate_models,
    validate_name,
)
from gateway.errors import InvalidRequestError, PermissionDeniedError

pytestmark = pytest.mark.timeout(10)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def test_secret_format_and_entropy() -> None:
    secrets = {generate_secret() for _ in range(200)}
    assert len(secrets) == 200
    for secret in secrets:
        assert secret.startswith("sk-")
        assert looks_like_secret(secret)
        body = secret.removeprefix("sk-")
        assert len(body) == 43  # 32 bytes, url-safe base64 without padding
        assert len(base64.urlsafe_b64decode(body + "=")) == 32
    # Every url-safe character shows up across the sample: the bytes are not drawn from a narrow alphabet.
    assert len(set("".join(s.removeprefix("sk-") for s in secrets))) == 64


@pytest.mark.parametrize(
    "value",
    ["", "sk-", "sk-short", "Bearer sk-" + "a" * 43, "pk-" + "a" * 43, "sk-" + "a" * 42 + "!", "sk-" + "a" * 201],
)
def test_malformed_secrets_are_rejected_before_hashing(value: str) -> None:
    assert not looks_like_secret(value)


def test_display_prefix_tells_keys_apart_without_revealing_them() -> None:
    secret = generate_secret()
    prefix = display_prefix(secret)
    assert prefix == secret[:9] and prefix.startswith("sk-")
    assert len(secret) - len(prefix) >= 37  # over 220 bits stay hidden


def test_hmac_digest_with_server_secret() -> None:
    hasher = KeyHasher(SecretStr("pepper"))
    assert hasher.keyed
    expected = hmac.new(b"pepper", b"sk-abc", hashlib.sha256).hexdigest()
    assert hasher.digest("sk-abc") == expected
    assert KeyHasher(SecretStr("other")).digest("sk-abc") != expected


def test_plain_sha256_without_server_secret() -> None:
    hasher = KeyHasher(None)
    assert not hasher.keyed
    assert hasher.digest("sk-abc") == hashlib.sha256(b"sk-abc").hexdigest()
    assert hasher.digest("sk-abc") != KeyHasher(SecretStr("pepper")).digest("sk-abc")


def test_digest_comparison() -> None:
    digest = KeyHasher(None).digest("sk-abc")
    assert KeyHasher.matches(digest, digest)
    assert not KeyHasher.matches(digest, KeyHasher(None).digest("sk-abd"))
    assert not KeyHasher.matches("", digest)


def test_key_state() -> None:
    key = ApiKey(name="a", prefix="sk-abcdef", created_at=NOW)
    assert key.state(NOW) is KeyState.ACTIVE
    expiring = ApiKey(name="a", prefix="sk-abcdef", created_at=NOW, expires_at=NOW + timedelta(hours=1))
    assert expiring.state(NOW) is KeyState.ACTIVE
    assert expiring.state(NOW + timedelta(hours=1)) is KeyState.EXPIRED
    assert ApiKey(name="a", prefix="", created_at=NOW, disabled=True).state(NOW) is KeyState.DISABLED
    assert ApiKey(name="a", prefix="", created_at=NOW, disabled=True, revoked=True).state(NOW) is KeyState.REVOKED


def test_limits_reject_negative_values() -> None:
    assert KeyLimits(0, None, 3).requests_per_minute == 0
    with pytest.raises(InvalidRequestError):
        KeyLimits(requests_per_minute=-1)


@pytest.mark.parametrize("name", ["alice", "team-a.prod_1", "A", "x" * 64])
def test_valid_names(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", "-lead", "has space", "a:b", "{tag}", "x" * 65, "é"])
def test_invalid_names(name: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        validate_name(name)
    assert caught.value.param == "name"


def test_models() -> None:
    assert validate_models(None) is None
    assert validate_models((" a", "b", "a")) == ("a", "b")
    with pytest.raises(InvalidRequestError):
        validate_models(("", " "))
    key = ApiKey(name="a", prefix="", created_at=NOW, models=("nemotron",))
    check_model(key, "nemotron")
    check_model(ApiKey(name="a", prefix="", created_at=NOW), "anything")
    with pytest.raises(PermissionDeniedError) as caught:
        check_model(key, "other")
    assert caught.value.param == "model" and caught.value.status_code == 403


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30d", timedelta(days=30)),
        ("12h", timedelta(hours=12)),
        ("90m", timedelta(minutes=90)),
        ("45s", timedelta(seconds=45)),
        ("2w", timedelta(weeks=2)),
        ("1d12h", timedelta(days=1, hours=12)),
        (" 1H30M ", timedelta(hours=1, minutes=30)),
    ],
)
def test_parse_duration(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "30", "d", "3q", "-5m", "1.5h", "0m", "0d0h", "12 h"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemotron-gateway")
    add_keys_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_create_arguments() -> None:
    args = _parser().parse_args(
        ["keys", "create", "--name", "a", "--rpm", "10", "--tpm", "0", "--expires-in", "1d", "--models", "m1, m2"]
    )
    assert (args.command, args.keys_verb, args.name) == ("keys", "create", "a")
    assert (args.rpm, args.tpm, args.expires_in, args.models) == (10, 0, timedelta(days=1), ["m1", "m2"])
    assert not hasattr(args, "max_concurrency")  # omitted: the server default


def test_cli_set_arguments() -> None:
    args = _parser().parse_args(["keys", "set", "a", "--max-concurrency", "default", "--disable"])
    assert (args.keys_verb, args.name, args.max_concurrency, args.disabled) == ("set", "a", None, True)
    assert not hasattr(args, "rpm") and not hasattr(args, "models")
    assert _parser().parse_args(["keys", "set", "a", "--enable"]).disabled is False


@pytest.mark.parametrize(
    "argv",
    [
        ["keys", "create", "--name", "a", "--rpm", "-1"],
        ["keys", "create", "--name", "a", "--expires-in", "soon"],
        ["keys", "set", "a", "--enable", "--disable"],
    ],
)
def test_cli_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(argv)
    assert exited.value.code == 2
    assert "error" in capsys.readouterr().err
