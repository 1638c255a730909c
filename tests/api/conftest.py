"""Real servers for the API tests: ``python -m corun.serve`` subprocesses on free loopback ports.

Each fixture starts one server with the embedded default model (random weights, byte-level
tokenizer), waits for ``/health`` and always stops it at the end of the session (terminate, then
kill). The server's log goes to a file that a failing start prints.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from experiments.serving_servers import free_port, wait_for_health

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0
MAX_MODEL_LEN = 128
GUARDED_NAME = "guarded-name"
# Small sizes keep the CPU steps cheap: the tiny default model decodes 16 slots in a few ms.
COMMON_ARGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--prefill-chunk-size",
    "64",
    # Packed prefill steps of 1024 tokens, not the H200 default's 8192: every step is padded to
    # T, and on a 2-core CPU an 8192-token step of the tiny model doubles the API suite's time.
    "--prefill-step-tokens",
    "1024",
    "--prefill-token-budget",
    "1024",
    "--log-level",
    "warning",
]


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen
    log_path: Path
    api_key: str | None = None

    def client(self, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, timeout=60.0, headers=headers, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by name (labels dropped: one model per server)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10.0).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name
                for label in ("finished_reason", "kind"):
                    if label in sample.labels:
                        key += f"[{sample.labels[label]}]"
                out[key] = sample.value
        return out

    def wait_for_metrics(self, ready, what: str, timeout_s: float = 60.0) -> dict[str, float]:
        """Poll /metrics until ``ready(metrics)``: waits on the event, the deadline only bounds
        it (a test that gets there failed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.metrics()
            if ready(metrics):
                return metrics
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {metrics}"
            time.sleep(0.05)

    def wait_for_idle(self, timeout_s: float = 20.0) -> dict[str, float]:
        """The metrics once no request runs and no KV block is used (or at the deadline: the
        caller's assertions on them then fail)."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.metrics()
            idle = (metrics["corun:kv_cache_blocks_used"] == 0
                    and metrics["corun:num_requests_running"] == 0)
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def launch(log_dir: Path, name: str, *args: str, api_key: str | None = None) -> Server:
    port = free_port()
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ)
    # One intra-op thread: on a small shared CPU, OpenMP spinning makes each step 10-20x slower.
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [
        sys.executable,
        "-m",
        "corun.serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *COMMON_ARGS,
        *args,
    ]
    if api_key:
        command += ["--api-key", api_key]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    server = Server(f"http://127.0.0.1:{port}", proc, log_path, api_key)
    if wait_for_health(proc, server.base_url, START_TIMEOUT_S):
        return server
    server.stop()
    pytest.fail(f"server {name} did not start; log:\n{log_path.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The main server: corun mode, 16 decode slots, the default queue limit."""
    srv = launch(
        tmp_path_factory.mktemp("serve"), "corun", "--mode", "corun", "--max-num-seqs", "16"
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def guarded_server(tmp_path_factory: pytest.TempPathFactory):
    """An API key, one running sequence, a queue of one sequence and a served name other than
    the model's: for the 401, 503 and model-name tests."""
    srv = launch(
        tmp_path_factory.mktemp("serve"),
        "guarded",
        "--max-num-seqs",
        "1",
        "--max-queue-len",
        "1",
        "--served-model-name",
        GUARDED_NAME,
        api_key="test-key",
    )
    yield srv
    srv.stop()


@pytest.fixture
def client(server: Server):
    with server.client() as c:
        yield c
