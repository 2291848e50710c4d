"""Opening a store by URL: the one module above every backend (each backend imports only the protocol)."""

from __future__ import annotations

from ftrun.store.base import Store
from ftrun.store.url import StoreUrl, parse_store_url, read_token_file

DEFAULT_CALL_TIMEOUT_S = 30.0


def open_store(
    url: str | StoreUrl, *, token: str | None = None, retry_deadline_s: float = 30.0, job: str = ""
) -> Store:
    """Open any store by URL.

    Args:
        url: see :class:`StoreUrl`.
        token: the shared secret of an embedded tcp store (``--rdzv-token`` /
            ``FTRUN_TOKEN``); ``token_file`` in the URL is the alternative.
        retry_deadline_s: how long an operation keeps retrying while the store is
            unreachable before it raises StoreUnavailable. Longer rides out a
            store restart; shorter notices a dead store sooner.
        job: the job the client works for, told to an embedded store (which
            an agent keeps serving at its own job's end while another uses it).
    """
    parsed = url if isinstance(url, StoreUrl) else parse_store_url(url)
    if parsed.scheme == "memory":
        from ftrun.store.memory import MemoryStore

        return MemoryStore()
    if parsed.scheme in ("tcp", "tcps"):
        from ftrun.store.tcp import TcpStoreClient

        host, port = parsed.endpoints[0]
        token_file = parsed.option("token_file")
        if token_file:
            token = read_token_file(token_file)
        tls = None
        if parsed.scheme == "tcps":
            from ftrun.store.tls import OPTIONS, client_context

            tls = client_context({k: v for k, v in parsed.options if k in OPTIONS})
        # One call waits for its answer no longer than it may retry: an agent cut off from the store must get
        # its hands back in time to act on it (its lease's clock decides, not a store call returning).
        timeout = min(retry_deadline_s, DEFAULT_CALL_TIMEOUT_S)
        return TcpStoreClient(
            host, port, token=token, retry_deadline_s=retry_deadline_s, call_timeout_s=timeout, tls=tls, job=job
        )
    from ftrun.store.etcd import EtcdStore

    return EtcdStore(parsed, retry_deadline_s=retry_deadline_s)
