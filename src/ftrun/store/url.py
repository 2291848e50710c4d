"""Store URLs: ``memory://``, ``tcp://HOST:PORT``, ``etcd://...``, parsed and validated once."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ftrun.errors import ConfigError
from ftrun.node.addresses import DEFAULT_ETCD_PORT, DEFAULT_STORE_PORT, bracketed, parse_endpoint


@dataclass(frozen=True, slots=True)
class StoreUrl:
    """A parsed store URL.

    ``memory://``, ``tcp://host:port``, ``etcd://[user:password@]host:port[,host:port...][/prefix]``.
    Options as query parameters: ``token_file`` (tcp), ``cacert``, ``cert``, ``key``
    (TLS; ``tcps://`` and ``etcds://`` turn TLS on, with the system CAs unless ``cacert``), ``user``,
    ``password_file`` (etcd auth).
    """

    scheme: str
    endpoints: tuple[tuple[str, int], ...] = ()
    prefix: str = ""
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    options: tuple[tuple[str, str], ...] = ()

    def option(self, name: str) -> str | None:
        return dict(self.options).get(name)

    @property
    def tls(self) -> bool:
        return self.scheme in ("tcps", "etcds")

    def at(self, host: str, port: int) -> StoreUrl:
        """The same store served at ``host:port`` (an embedded store's real port, a successor's address)."""
        return replace(self, endpoints=((host, port),))

    @property
    def display(self) -> str:
        """The URL without secrets, for messages."""
        hosts = ",".join(f"{bracketed(h)}:{p}" for h, p in self.endpoints)
        return f"{self.scheme}://{hosts}{'/' + self.prefix if self.prefix else ''}"

    def __str__(self) -> str:  # in a message: never the fields, which hold the password
        return self.display


_OPTIONS = {"tcp": {"token_file", "cacert", "cert", "key"}, "etcd": {"cacert", "cert", "key", "user", "password_file"}}
_DEFAULT_PORTS = {"tcp": DEFAULT_STORE_PORT, "etcd": DEFAULT_ETCD_PORT}


def parse_store_url(text: str) -> StoreUrl:
    """Parse a store URL; raises ConfigError naming what is wrong."""
    flag = "store URL"
    scheme, sep, rest = text.partition("://")
    family = {"etcds": "etcd", "tcps": "tcp"}.get(scheme, scheme)
    if not sep or family not in ("memory", "tcp", "etcd"):
        raise ConfigError(flag, f"{text!r} has no known scheme", "use memory://, tcp://HOST:PORT or etcd://HOST:PORT")
    if family == "memory":
        if rest:
            raise ConfigError(flag, f"memory:// takes nothing after the scheme, got {rest!r}", "use memory://")
        return StoreUrl("memory")
    location, _, query = rest.partition("?")
    options = urllib.parse.parse_qsl(query, keep_blank_values=True)
    unknown = sorted({k for k, _ in options} - _OPTIONS[family])
    if unknown:
        raise ConfigError(flag, f"unknown option {unknown[0]!r}", f"use one of {sorted(_OPTIONS[family])}")
    auth, at, hosts_part = location.rpartition("@")
    user = password = None
    if at:
        user, _, password = (urllib.parse.unquote(p) for p in auth.partition(":"))
    hosts, slash, prefix = hosts_part.partition("/")
    if slash and family != "etcd":
        raise ConfigError(flag, f"a key prefix is only for etcd, got {text!r}", "drop the /PREFIX")
    endpoints = tuple(_endpoint(h, _DEFAULT_PORTS[family]) for h in hosts.split(","))
    if family == "tcp" and len(endpoints) != 1:
        raise ConfigError(flag, "tcp:// takes exactly one HOST:PORT", f"use e.g. tcp://node0:{DEFAULT_STORE_PORT}")
    scheme_out = scheme if scheme in ("etcds", "tcps") else family
    return StoreUrl(scheme_out, endpoints, prefix.strip("/"), user, password, tuple(options))


def _endpoint(text: str, default_port: int) -> tuple[str, int]:
    host, port = parse_endpoint(text, "store URL")
    if not host:
        raise ConfigError("store URL", "an endpoint has no host", "use HOST:PORT")
    return host, default_port if port is None else port


def tcp_url(host: str, port: int, options: Mapping[str, str]) -> str:
    """The embedded store's URL: over TLS (``tcps://``) when --rdzv-conf names certificates or protocol=https."""
    files = "&".join(f"{k}={v}" for k, v in options.items() if k in ("cacert", "cert", "key"))
    if options.get("protocol") == "https" or files:
        return f"tcps://{bracketed(host)}:{port}{'?' + files if files else ''}"
    return f"tcp://{bracketed(host)}:{port}"


def read_token_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ConfigError("token_file", f"cannot read {path}: {e.strerror}", "check the path and permissions") from None
    if not token:
        raise ConfigError("token_file", f"{path} is empty", "write the shared token into it")
    return token
