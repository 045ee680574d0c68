"""`Settings`: the namespace's characters, types and ranges of the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from helpers import cli
from prefixq.core import settings as settings_module
from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings


@pytest.mark.parametrize(
    "namespace", ["nsA:team2", "nsA*", "ns{a}", "ns a", "", "n" * 65, "ns[1]", "nsé"]
)
def test_a_namespace_outside_the_allowed_characters_is_refused(namespace: str) -> None:
    """A namespace with ':' (whose keys would match another namespace's ACL pattern), a glob or
    hash-tag character, a space, a non-ASCII letter, empty or over 64 characters is refused."""
    with pytest.raises(ConfigError, match="use 1 to 64 letters, digits"):
        Settings(namespace=namespace)


def test_namespaces_of_letters_digits_dot_dash_underscore_are_accepted() -> None:
    """The documented alphabet: letters, digits, '_', '.', '-', up to 64 characters."""
    for ns in ("nsA", "team-a.prod_2", "x" * 64):
        assert Settings(namespace=ns).keys.config == f"{ns}:config"


def test_cli_refuses_a_namespace_with_a_colon_as_a_usage_error() -> None:
    """`prefixq check --namespace nsA:team2` exits 2 naming the rule, before touching Redis."""
    p = cli(None, "check", "--namespace", "nsA:team2", timeout=60)
    assert p.returncode == 2 and "namespace 'nsA:team2' is not allowed" in p.stderr


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"PREFIXQ_MAX_INFLIGHT": "-5"}, "max_inflight must be >= 0"),
        ({"PREFIXQ_HEARTBEAT_S": "0"}, "heartbeat_s must be a positive number"),
        ({"PREFIXQ_HEARTBEAT_TTL_S": "nan"}, "heartbeat_ttl_s must be a positive number"),
        ({"PREFIXQ_CLAIM_IDLE_S": "-1"}, "claim_idle_s must be a positive number"),
        ({"PREFIXQ_GRACE_S": "-1"}, "grace_s must be a number >= 0"),
        ({"PREFIXQ_RESULT_TTL_S": "0"}, "result_ttl_s must be positive"),
        ({"PREFIXQ_PREFIX_TTL_S": "-5"}, "prefix_ttl_s must be positive"),
        ({"PREFIXQ_MAX_MESSAGES": "0"}, "max_messages must be positive"),
        ({"PREFIXQ_MAP_MAX_ENTRIES": "0"}, "map_max_entries must be positive"),
        ({"PREFIXQ_PREFIX_CACHE_ENTRIES": "-1"}, "prefix_cache_entries must be >= 0"),
        ({"PREFIXQ_AFFINITY_MIN_MATCH": "5"}, "affinity_min_match must be a share in"),
        ({"PREFIXQ_GUARD_FACTOR": "-1"}, "guard_factor must be a positive number"),
        ({"PREFIXQ_CODEC_LEVEL": "99"}, "codec_level for zlib must be -1"),
        ({"PREFIXQ_CODEC": "zstd", "PREFIXQ_CODEC_LEVEL": "0"}, "codec_level for zstd"),
        ({"PREFIXQ_READ_COUNT": "99999999999999999999999"}, "read_count must be at most"),
        ({"PREFIXQ_HEARTBEAT_TTL_S": "1e23"}, "heartbeat_ttl_s must be at most"),
        ({"PREFIXQ_SHARDS": "10000000"}, "shards must be at most 4,096"),
        ({"PREFIXQ_MIN_REPLICAS_ACKED_TIMEOUT_MS": "1e23"}, "is not a valid int"),
        ({"PREFIXQ_MIN_REPLICAS_ACKED_TIMEOUT_MS": "99999999999"}, "must be at most 3,600,000"),
        ({"PREFIXQ_RESULT_TTL_S": "99999999999999"}, "result_ttl_s must be at most"),
        ({"PREFIXQ_HEARTBEAT_S": "30"}, r"heartbeat_s \(30.0\) must be below heartbeat_ttl_s"),
    ],
)
def test_numbers_out_of_range_are_config_errors(env: dict[str, str], says: str) -> None:
    """A value that would fail mid-submit (an expire time Redis refuses, a compression level
    zlib refuses) or stall a worker silently (no room ever, a heartbeat loop without a pause)
    is refused when the settings are read."""
    with pytest.raises(ConfigError, match=says):
        Settings.from_env(env)


def test_the_defaults_and_boundary_values_are_accepted() -> None:
    s = Settings.from_env(
        {
            "PREFIXQ_GRACE_S": "0",
            "PREFIXQ_MAX_INFLIGHT": "0",
            "PREFIXQ_AFFINITY_MIN_MATCH": "1",
            "PREFIXQ_CODEC": "zstd",
            "PREFIXQ_CODEC_LEVEL": "19",
        }
    )
    assert (s.grace_s, s.max_inflight, s.codec_level) == (0.0, 0, 19)
    assert Settings(codec="none", codec_level=5).codec_level == 5  # no level to check


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"shards": "2"}, "shards must be an int, not '2'"),
        ({"gc_freeze": "no"}, "gc_freeze must be a bool"),
        ({"max_inflight": 1.5}, "max_inflight must be an int"),
        ({"read_count": True}, "read_count must be an int"),
        ({"api_keys": 5}, r"api_keys must be a str, not \*\*\*"),
    ],
)
def test_keyword_values_of_the_wrong_type_are_config_errors(
    overrides: dict[str, object], says: str
) -> None:
    """Keywords (Python, an RQ job's JSON kwargs) are not parsed like env vars: a string for a
    number is refused by name instead of a TypeError later (or a truthy 'no' for a bool)."""
    with pytest.raises(ConfigError, match=says):
        Settings.from_env({}, **overrides)
    assert Settings.from_env({}, heartbeat_s=1).heartbeat_s == 1.0  # an int is a float


def test_cli_refuses_a_codec_level_before_enqueueing_anything(
    settings: Settings, r: redis.Redis, tmp_path: Path
) -> None:
    """`submit --codec-level 99` used to enqueue the head, fail in zlib and cancel the burst
    (exit 1); now it is a usage error naming the setting and nothing is written."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(f'{{"id": "q{i}", "prompt": "hi {i}"}}\n' for i in range(12)))
    p = cli(settings, "submit", str(path), "--shards", "1", "--codec-level", "99", timeout=60)
    assert p.returncode == 2 and "codec_level for zlib must be -1" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not list(r.scan_iter(match=f"{settings.namespace}:*"))


def test_a_misspelt_environment_variable_is_warned_about(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PREFIXQ_TENANT_WEIGHT=team-a=3` (no s) was ignored without a word: the weights the
    operator meant never applied. It is still ignored, with a warning naming the setting."""
    monkeypatch.setattr(settings_module, "_WARNED", set())
    with caplog.at_level("WARNING", logger="prefixq.core.settings"):
        s = Settings.from_env(
            {"PREFIXQ_TENANT_WEIGHT": "team-a=3", "PREFIXQ_VENV": ".venv", "PREFIXQ_SHARDS": "2"}
        )
        Settings.from_env({"PREFIXQ_TENANT_WEIGHT": "team-a=3"})  # said once per process
    assert s.tenant_weights == "" and s.shards == 2
    assert [r.getMessage() for r in caplog.records] == [
        "PREFIXQ_TENANT_WEIGHT is not a prefixq setting and is ignored "
        "(did you mean PREFIXQ_TENANT_WEIGHTS?)"
    ]
