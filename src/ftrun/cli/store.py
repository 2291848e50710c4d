"""``ftrun store``: run the embedded store on its own, e.g. on a machine that runs no workers."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Mapping, Sequence
from types import FrameType

from ftrun.cli.rdzv_flags import store_token
from ftrun.errors import ConfigError
from ftrun.node.addresses import DEFAULT_STORE_PORT, is_loopback, parse_port
from ftrun.store.tcp_server import TcpStoreServer
from ftrun.store.tls import server_context
from ftrun.strangers import raise_file_limit


def main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    p = argparse.ArgumentParser(prog="ftrun store", description="Serve ftrun's embedded key-value store.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; 0.0.0.0 for all)")
    p.add_argument("--port", default=str(DEFAULT_STORE_PORT), help="port to bind (0: any free port)")
    p.add_argument("--token", default=None, help="shared secret clients must prove (or FTRUN_TOKEN)")
    p.add_argument("--token-file", default=None, help="file holding the shared secret")
    p.add_argument("--cert", default=None, help="serve over TLS with this certificate (clients use tcps://)")
    p.add_argument("--key", default=None, help="the certificate's private key")
    p.add_argument("--cacert", default=None, help="require clients' certificates signed by this CA (mutual TLS)")
    a = p.parse_args(list(argv))
    try:
        port = parse_port("--port", a.port)
        token = store_token(a.token, a.token_file, environ)
        files = {k: v for k, v in (("cert", a.cert), ("key", a.key), ("cacert", a.cacert)) if v}
        tls = server_context(files) if files else None
    except ConfigError as e:
        print(f"ftrun store: error: {e}", file=sys.stderr)
        return 2
    if token is None and tls is None and not is_loopback(a.host):
        print("ftrun store: warning: serving beyond loopback without a token; set FTRUN_TOKEN", file=sys.stderr)
    raise_file_limit()  # as an agent does: room for its clients and for strangers at its port
    server = TcpStoreServer(a.host, port, token=token, tls=tls)

    def stop(signum: int, frame: FrameType | None) -> None:
        server.stop()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)

    def ready(bound: int) -> None:
        print(f"ftrun store: serving on {a.host}:{bound} (store id {server.store_id})", file=sys.stderr, flush=True)

    server.serve_forever(on_ready=ready)
    return 0
