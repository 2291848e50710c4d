"""The rendezvous flags: ``--rdzv-conf`` (every key torchrun takes) and the store's URL and token.

Each torchrun key either works, or is refused with a line saying why ftrun does
not need it; keys about torch's own TCPStore are accepted with a notice.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Mapping

from ftrun.cli.flags import parse_int, parse_seconds
from ftrun.config import NO_RUN_ID, RdzvConf
from ftrun.errors import ConfigError
from ftrun.node.addresses import DEFAULT_ETCD_PORT, parse_endpoint
from ftrun.store.url import StoreUrl, parse_store_url, read_token_file, tcp_url

FLAG = "--rdzv-conf"
DEFAULT_KEEP_ALIVE_INTERVAL_S = RdzvConf().keep_alive_interval_s
_DURATIONS = {
    "join_timeout": "join_timeout_s",
    "timeout": "join_timeout_s",  # torchrun's older name for join_timeout (etcd-v2)
    "last_call_timeout": "last_call_timeout_s",
    "close_timeout": "close_timeout_s",
    "exit_barrier_timeout": "exit_barrier_timeout_s",
    "keep_alive_interval": "keep_alive_interval_s",
    "read_timeout": "read_timeout_s",
    "heartbeat_timeout": "heartbeat_timeout_s",
}
_BOOLS = ("is_host", "use_libuv", "use_agent_store")
# torchrun's keys about torch's own TCPStore: accepted, said once at start, without effect.
_NOT_APPLICABLE = {
    "use_libuv": "--rdzv-conf use_libuv has no effect: ftrun's rendezvous store is its own, not torch's TCPStore",
    "use_agent_store": "--rdzv-conf use_agent_store has no effect: ftrun never shares its rendezvous store "
    "with the workers",
}
# etcd TLS keys, torch's two spellings -> the store URL's options
_ETCD_FILES = {"cacert": "cacert", "ca_cert": "cacert", "cert": "cert", "ssl_cert": "cert", "key": "key"}
_ETCD_FILES["ssl_cert_key"] = "key"
_REFUSED = {
    "rank": "the node's rank is --node-rank (static rendezvous), or the rendezvous' to give (elastic)",
}


_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def parse_run_id(text: str | None, *, standalone: bool = False) -> str:
    """The job id: torchrun's default ``none``, so that nodes started with the same command meet (a rerun's
    logs go to ``none.1``, ``none.2``...); ``--standalone`` draws a fresh one, as torchrun does.

    Run ids name directories and store keys, so they are kept to a safe alphabet.
    """
    if standalone:
        return f"ftrun-{uuid.uuid4().hex[:12]}"
    text = text or NO_RUN_ID
    if not _RUN_ID.match(text) or text in (".", ".."):
        raise ConfigError("--rdzv-id", f"{text!r} is not a valid run id", "use letters, digits, '.', '_' and '-'")
    return text


def parse_rdzv_conf(text: str) -> RdzvConf:  # noqa: PLR0912 - one branch per kind of torchrun key
    known = sorted([*_DURATIONS, "keep_alive_max_attempt", *_BOOLS, "store_type", "protocol", "etcd_prefix"])
    known += sorted(_ETCD_FILES)
    values: dict[str, object] = {}
    notices: list[str] = []
    etcd: dict[str, str] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ConfigError(FLAG, f"expected KEY=VALUE, got {item!r}", "pass e.g. --rdzv-conf join_timeout=900")
        if key in _DURATIONS:
            values[_DURATIONS[key]] = parse_seconds(f"{FLAG} {key}", value, fix=f"pass e.g. {FLAG} {key}=5")
        elif key == "keep_alive_max_attempt":
            values[key] = parse_int(f"{FLAG} {key}", value, minimum=1)
        elif key in _BOOLS:
            lowered = value.lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no"):
                raise ConfigError(f"{FLAG} {key}", f"expected true or false, got {value!r}", f"pass {key}=true")
            if key == "is_host":
                values[key] = lowered in ("1", "true", "yes")
            else:
                notices.append(_NOT_APPLICABLE[key])
        elif key == "store_type":
            if value.lower() != "tcp":
                raise ConfigError(
                    f"{FLAG} store_type",
                    f"{value!r}: ftrun's c10d store is its embedded TCP store (a file store is not needed)",
                    "drop store_type, or use --rdzv-backend etcd for a store outside the job",
                )
        elif key == "protocol":
            if value.lower() not in ("http", "https"):
                raise ConfigError(f"{FLAG} protocol", f"expected http or https, got {value!r}", "pass protocol=https")
            etcd["protocol"] = value.lower()
        elif key in _ETCD_FILES:
            etcd[_ETCD_FILES[key]] = value
        elif key == "etcd_prefix":
            etcd["prefix"] = value.strip("/")
        elif key in _REFUSED:
            raise ConfigError(f"{FLAG} {key}", f"ftrun does not take it: {_REFUSED[key]}", f"drop {key}")
        else:
            raise ConfigError(FLAG, f"unknown key {key!r}", f"use one of {', '.join(known)}")
    heartbeat = values.pop("heartbeat_timeout_s", None)
    if isinstance(heartbeat, float):  # torch's name for the dead-node detection time
        interval = values.get("keep_alive_interval_s", DEFAULT_KEEP_ALIVE_INTERVAL_S)
        assert isinstance(interval, float)
        values["keep_alive_max_attempt"] = max(1, math.ceil(heartbeat / interval))
    return RdzvConf(**values, notices=tuple(notices), etcd=tuple(sorted(etcd.items())))  # type: ignore[arg-type]


def store_token(token: str | None, token_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The embedded store's token: --rdzv-token-file, else --rdzv-token, else FTRUN_TOKEN.

    A file keeps the secret out of ``ps`` output; prefer it on shared machines.
    """
    if token_file:
        return read_token_file(token_file)
    return token or environ.get("FTRUN_TOKEN") or None


def rdzv_store_url(
    backend: str, endpoint: str, default_tcp_port: int, etcd: tuple[tuple[str, str], ...] = ()
) -> StoreUrl:
    """The store URL for ``--rdzv-backend``/``--rdzv-endpoint``; raises ConfigError naming the flag."""
    flag = "--rdzv-endpoint"
    if backend in ("etcd", "etcd-v2"):
        if not endpoint:
            raise ConfigError(
                flag, "the etcd backend needs an endpoint", f"pass e.g. --rdzv-endpoint etcd0:{DEFAULT_ETCD_PORT}"
            )
        url = etcd_url(endpoint, dict(etcd))
    else:
        host, port = parse_endpoint(endpoint)
        url = tcp_url(host or "127.0.0.1", default_tcp_port if port is None else port, dict(etcd))
    try:
        return parse_store_url(url)
    except ConfigError as e:
        raise ConfigError(flag, e.problem, e.fix) from None


def etcd_url(endpoint: str, options: Mapping[str, str]) -> str:
    """The etcd store URL of ``--rdzv-endpoint`` with the --rdzv-conf TLS keys and prefix folded in."""
    if endpoint.startswith(("etcd://", "etcds://")):
        return endpoint
    scheme = "etcds" if options.get("protocol") == "https" or "cacert" in options else "etcd"
    prefix = f"/{options['prefix']}" if options.get("prefix") else ""
    query = "&".join(f"{k}={v}" for k, v in options.items() if k in ("cacert", "cert", "key"))
    return f"{scheme}://{endpoint}{prefix}{'?' + query if query else ''}"
