"""`Settings`: the namespace's characters (issue 11 item 11)."""

from __future__ import annotations

import pytest

from helpers import cli
from prefixq.errors import ConfigError
from prefixq.settings import Settings


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
