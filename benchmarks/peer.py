"""`PeerServer`: another OpenAI-compatible server to measure kvrelay against, started for one benchmark.

The peer script (``../shared/peers/vllm-cpu.sh`` for vLLM's CPU build) is called as
``SCRIPT serve MODEL_DIR PORT`` and must serve ``/v1`` on ``127.0.0.1:PORT``; it is ready when
``GET /v1/models`` answers. It runs in its own process group (stopped with SIGTERM, then SIGKILL)
and logs to a file whose tail goes into any start-up error. The script should ``exec`` the server, so
that SIGTERM reaches it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.error
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvrelay.benchmarks.deployment import free_ports, get_text, stop_process_group

DEFAULT_PEER_SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "peers" / "vllm-cpu.sh"
STARTUP_TIMEOUT_S = 900.0  # vLLM's CPU build compiles for ~3.5 min on 2 cores


class PeerServer:
    """``with PeerServer(script, model_dir) as peer: peer.url`` (no trailing ``/v1``)."""

    def __init__(self, script: str | Path, model_dir: str | Path, *, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        """``extra_args``: flags after ``MODEL_DIR PORT`` (vLLM's own); ``env``: set over this environment."""
        self.script, self.model_dir = Path(script), Path(model_dir).resolve()
        self.extra_args = list(extra_args)
        self.env = None if env is None else {**os.environ, **env}
        if not self.script.is_file():
            raise FileNotFoundError(f"peer script {self.script} not found; pass --peer-script")
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="kvrelay-peer-", suffix=".log", delete=False)  # noqa: SIM115
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> PeerServer:
        """Start and wait until ``/v1/models`` answers.

        Raises:
            RuntimeError: the peer exited or did not answer in ``timeout_s``; carries its log's tail.
        """
        self._proc = subprocess.Popen(["bash", str(self.script), "serve", str(self.model_dir), str(self.port),
                                       *self.extra_args], stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True, env=self.env)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                get_text(self.url + "/v1/models", timeout_s=5)
                return self
            except (urllib.error.URLError, OSError):
                pass
            code = self._proc.poll()
            if code is not None or time.monotonic() > deadline:
                tail = Path(self._log.name).read_text(errors="replace")[-4000:]
                self.stop()
                why = f"exited with code {code}" if code is not None else f"did not serve in {timeout_s:.0f} s"
                raise RuntimeError(f"peer {self.script.name} {why}:\n{tail}")
            time.sleep(2.0)

    def stop(self) -> None:
        """SIGTERM the peer, SIGKILL its process group after 30 s; idempotent."""
        if self._proc is not None:
            stop_process_group(self._proc)
        self._proc = None

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        Path(self._log.name).unlink(missing_ok=True)
