"""The embedded store served by the agent (c10d-style) and by `ftrun store`."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ftrun.store.tcp import TcpStoreClient
from tests.integration.conftest import PortTaken, Result, WriteScript, run_ftrun, with_free_port

USES_STORE = """
import os, sys
from ftrun.store.factory import open_store
store = open_store(sys.argv[1], token=open(sys.argv[2]).read().strip())
store.add("/ranks-seen", 1)
print("rank", os.environ["RANK"], "saw the store", flush=True)
"""


def test_agent_hosts_the_store_when_the_endpoint_is_local(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", USES_STORE)
    (tmp_path / "token").write_text("s3cret\n")

    def attempt(port: int) -> tuple[Result, int]:
        r = run_ftrun(
            tmp_path, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-token-file", "token", "w.py", f"tcp://127.0.0.1:{port}", "token",
        )  # fmt: skip
        if "cannot host the store" in r.stderr:
            shutil.rmtree(r.run_dir)  # the next try's logs go where the Result looks
            raise PortTaken(r.stderr)
        return r, port

    r, port = with_free_port(attempt)
    assert r.returncode == 0, r.stderr
    assert f"hosting the rendezvous store on 127.0.0.1:{port}" in r.stderr
    assert sorted(r.stdout.splitlines()) == ["rank 0 saw the store", "rank 1 saw the store"]
    assert any(e["kind"] == "store_hosted" for e in r.events())


def test_ftrun_store_command(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftrun", "store", "--port", "0", "--token-file", str(tmp_path / "token")],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        found = re.search(r"serving on 127\.0\.0\.1:(\d+)", line)
        assert found, line
        client = TcpStoreClient("127.0.0.1", int(found.group(1)), token="tok")
        assert client.put("/x", b"1") > 0
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        assert proc.stderr is not None
        proc.stderr.close()
