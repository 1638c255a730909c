"""The servers a ``bench_serving --launch`` run starts: one ``python -m corun.serve`` per mode or
``--variant`` (``ServerSpec``), each on a free port, waited for until ``/health`` answers, and
stopped after its runs."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# Graph capture of the real models is part of a server's start-up.
SERVER_START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ServerSpec:
    """One server of a ``--launch`` run: its engine mode, the flags it adds to
    ``--server-args``, and the label its records carry (the mode itself for a plain mode)."""

    label: str
    mode: str
    extra_args: str = ""


def parse_variant(text: str) -> ServerSpec:
    """``LABEL=MODE FLAGS...`` -> ServerSpec (``--variant``)."""
    label, sep, rest = text.partition("=")
    mode, _, extra = rest.strip().partition(" ")
    if not sep or not label.strip() or not mode:
        raise argparse.ArgumentTypeError(
            f"--variant: expected LABEL=MODE [FLAGS...], got {text!r}")
    return ServerSpec(label.strip(), mode, extra.strip())


def server_specs(args: argparse.Namespace) -> list[ServerSpec]:
    specs = [ServerSpec(m.strip(), m.strip()) for m in args.modes.split(",") if m.strip()]
    specs += args.variant
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"--modes/--variant: labels must be unique, got {labels}")
    return specs


def launch_server(spec: ServerSpec, port: int, args: argparse.Namespace) -> subprocess.Popen:
    """Start ``python -m corun.serve`` for one server and wait for /health."""
    mode = spec.mode
    command = [
        sys.executable,
        "-m",
        "corun.serve",
        "--mode",
        mode,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args.server_args.split(),
        *spec.extra_args.split(),
    ]
    if args.model:
        command += ["--model", args.model]
    print("starting:", " ".join(command), flush=True)
    proc = subprocess.Popen(command, cwd=Path(__file__).resolve().parent.parent)
    if wait_for_health(proc, f"http://127.0.0.1:{port}", SERVER_START_TIMEOUT_S):
        return proc
    if proc.poll() is not None:
        raise RuntimeError(f"server {spec.label} exited with {proc.returncode}")
    proc.kill()
    raise TimeoutError(f"server {spec.label} did not become healthy")


def wait_for_health(proc: subprocess.Popen, base_url: str, timeout_s: float,
                    poll_s: float = 0.5) -> bool:
    """Poll ``base_url``/health until it answers 200 (True), the process exits or ``timeout_s``
    passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    return False


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
