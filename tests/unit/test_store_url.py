"""The store's endpoint has one home, store/url.py: every form a user writes parsed once, every mistake named."""

from __future__ import annotations

import pytest

from ftrun.errors import ConfigError
from ftrun.store.url import parse_store_url, tcp_url


@pytest.mark.parametrize(
    ("text", "display", "tls"),
    [
        ("memory://", "memory://", False),
        ("tcp://node0:29400", "tcp://node0:29400", False),
        ("tcp://node0", "tcp://node0:29400", False),  # the store's default port
        ("tcps://node0:1234?cacert=ca.pem", "tcps://node0:1234", True),
        ("tcp://[fe80::1]:29400", "tcp://[fe80::1]:29400", False),
        ("etcd://e1:2379,e2:2379,e3/jobs", "etcd://e1:2379,e2:2379,e3:2379/jobs", False),
        ("etcds://u:p%40ss@e1:2379", "etcds://e1:2379", True),
    ],
)
def test_every_form_is_parsed_once_into_one_value(text: str, display: str, tls: bool) -> None:
    url = parse_store_url(text)
    assert (url.display, url.tls) == (display, tls)
    assert parse_store_url(url.display).display == display  # what a message says can be written again
    assert url.at("node9", 7).endpoints == (("node9", 7),)  # a successor's address, the rest kept


def test_credentials_are_kept_but_never_shown() -> None:
    url = parse_store_url("etcds://u:p%40ss@e1:2379?cacert=ca.pem")
    assert (url.user, url.password, url.option("cacert")) == ("u", "p@ss", "ca.pem")
    assert "p@ss" not in f"{url} {url!r}"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("node0:29400", "no known scheme"),
        ("http://node0", "no known scheme"),
        ("memory://x", "memory:// takes nothing"),
        ("tcp://a:1,b:2", "exactly one HOST:PORT"),
        ("tcp://node0/prefix", "only for etcd"),
        ("tcp://node0?user=u", "unknown option 'user'"),
        ("tcp://:29400", "no host"),
    ],
)
def test_a_bad_url_names_what_is_wrong(text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_store_url(text)


def test_the_embedded_stores_url_is_tls_when_the_conf_asks() -> None:
    assert tcp_url("node0", 29400, {}) == "tcp://node0:29400"
    assert tcp_url("::1", 5, {"protocol": "https"}) == "tcps://[::1]:5"
    assert parse_store_url(tcp_url("node0", 5, {"cacert": "ca.pem"})).option("cacert") == "ca.pem"
