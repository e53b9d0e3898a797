"""A real `kvtier serve` per test module: the binary from KVTIER_BIN, else
the workspace's release or debug build; its own data directory, port and
shm socket; stopped (SIGTERM) when the module is done."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

import kvtier

ROOT = Path(__file__).resolve().parents[2]


def server_binary() -> Path:
    if os.environ.get("KVTIER_BIN"):
        return Path(os.environ["KVTIER_BIN"])
    for profile in ("release", "debug"):
        path = ROOT / "target" / profile / "kvtier"
        if path.exists():
            return path
    pytest.exit("no kvtier binary: set KVTIER_BIN or run `cargo build`", returncode=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    address: str
    shm_socket: str
    process: subprocess.Popen

    def client(self, **kw) -> kvtier.Client:
        return kvtier.Client(self.address, shm_socket=self.shm_socket, **kw)


def start(data_dir: Path, *extra: str, scheme: str = "http", host: str = "127.0.0.1", **client_kw) -> Server:
    """Starts a server with `extra` flags; ready once a client built with
    `client_kw` gets its statistics."""
    port = free_port()
    log = open(data_dir.parent / f"server-{port}.log", "w")
    process = subprocess.Popen(
        [
            str(server_binary()),
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--metrics-listen",
            "off",
            "--data-dir",
            str(data_dir),
            "--device-bytes",
            "8MiB",
            "--host-bytes",
            "64MiB",
            "--nvme-bytes",
            "64MiB",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    # Even if pytest exits without running teardown (a BaseException).
    atexit.register(lambda: process.poll() is None and process.kill())
    address = f"{scheme}://{host}:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            kvtier.Client(address, **client_kw).stats()
            break
        except kvtier.errors.Unavailable:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"kvtier serve did not start; see {log.name}")
            time.sleep(0.05)
    return Server(address, str(data_dir / "shm.sock"), process)


def stop(server: Server) -> None:
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    s = start(tmp_path_factory.mktemp("kvtier") / "data")
    yield s
    stop(s)


@pytest.fixture(scope="module")
def client(server: Server) -> kvtier.Client:
    return server.client()
