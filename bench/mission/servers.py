"""Starting and stopping one configuration exactly as a user does.

    server = make(cfg, port, model, run_dir)
    startup_s = server.start(timeout_s)   # blocks until /health is ready; RuntimeError otherwise
    ...                                   # server.url
    clean = server.stop()                 # always call it (a finally): every process it started ends

pdserve: `scripts/pd_start.sh FLAGS --port P` (it bootstraps, launches the group under setsid,
waits for /health "ok", writes runs/<P>/), `scripts/pd_start.sh stop --port P` (SIGTERM, SIGKILL
after 10 s). The start-up time is that command's wall time: what a user waits for. The logs
under runs/<P>/ end up in the run's `server/` (moved when this start made that directory).
Peers (vLLM, llama.cpp's server): `scripts/peer_<name>.sh serve --port P` in its own process
group, /health polled, the group stopped with bench/agentx/process_group.py.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from bench.agentx import process_group
from bench.mission.configs import LLAMACPP, VLLM, Config

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".venv-vllm"
LLAMACPP_BIN = Path(os.environ.get("PD_LLAMACPP_DIR", Path.home() / ".cache" / "pdserve" / "llamacpp")) / "build" / "bin"


def peer_missing(peer: str) -> str:
    """Why `peer` cannot start without its setup (serve would run that first: GBs or minutes of
    building), or "" when it can."""
    if peer == VLLM and not (VLLM_VENV / "bin" / "vllm").exists():
        return f"{VLLM_VENV} is missing (scripts/peer_vllm.sh setup makes it)"
    if peer == LLAMACPP and not (LLAMACPP_BIN / "llama-server").exists():
        return f"{LLAMACPP_BIN}/llama-server is missing (scripts/peer_llamacpp.sh setup builds it)"
    return ""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class PdStart:
    def __init__(self, cfg: Config, port: int, model: str, run_dir: Path, root: Path = ROOT) -> None:
        """`root`: the checkout whose scripts/pd_start.sh runs (another one: a before/after)."""
        self.port, self.run_dir, self.root = port, run_dir, root
        self.pd_start = root / "scripts" / "pd_start.sh"
        self.url = f"http://127.0.0.1:{port}"
        self.command = [str(self.pd_start), *cfg.flags, "--port", str(port), *(["--model", model] if model else [])]
        self.env = dict(cfg.env)
        self.port_dir = root / "runs" / str(port)
        self._made_port_dir = not self.port_dir.exists()
        self._started = False

    def start(self, timeout_s: float) -> float:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, "PD_START_TIMEOUT_S": str(int(timeout_s))}
        self._started = True
        t0 = time.monotonic()
        with open(self.run_dir / "pd_start.log", "wb") as log:
            # pd_start.sh gives up by itself after PD_START_TIMEOUT_S; the margin covers its
            # bootstrap check and its own stop.
            rc = subprocess.run(self.command, cwd=self.root, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, timeout=timeout_s + 120).returncode
        elapsed = time.monotonic() - t0
        if rc != 0:
            raise RuntimeError(f"pd_start.sh exited with {rc}:\n{_tail(self.run_dir / 'pd_start.log')}")
        return elapsed

    def stop(self) -> bool:
        """pd_start.sh stop; True unless it needed SIGKILL. Keeps the logs in run_dir/server."""
        if not self._started:
            return True
        pid_file = self.port_dir / "pd_start.pid"
        pgid = int(pid_file.read_text()) if pid_file.exists() else None
        with open(self.run_dir / "pd_stop.log", "wb") as log:
            subprocess.run([str(self.pd_start), "stop", "--port", str(self.port)], cwd=self.root,
                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=120)
        clean = "SIGKILL" not in (self.run_dir / "pd_stop.log").read_text(errors="replace")
        if pgid is not None and process_group.group_alive(pgid):  # pd_start.sh does not check after its SIGKILL
            clean = False
            os.killpg(pgid, signal.SIGKILL)
            for _ in range(50):
                if not process_group.group_alive(pgid):
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError(f"processes of group {pgid} (port {self.port}) survived SIGKILL")
        self._keep_logs()
        return clean

    def _keep_logs(self) -> None:
        if not self.port_dir.is_dir():
            return
        dest = self.run_dir / "server"
        if self._made_port_dir:
            shutil.move(str(self.port_dir), str(dest))
        else:  # a port directory the user had before: copy, leave theirs alone
            dest.mkdir(parents=True, exist_ok=True)
            for f in self.port_dir.glob("*.log"):
                shutil.copy2(f, dest / f.name)


class Peer:
    def __init__(self, peer: str, port: int, model: str, run_dir: Path, stop_timeout_s: float) -> None:
        self.peer, self.run_dir, self.stop_timeout_s = peer, run_dir, stop_timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.command = [str(ROOT / "scripts" / f"peer_{peer}.sh"), "serve", "--port", str(port),
                        *(["--model", model] if model else [])]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> float:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.run_dir / f"{self.peer}.log", "wb") as log:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process_group.wait_healthy(self.url, self.proc, timeout_s)
        except RuntimeError as e:
            raise RuntimeError(f"{e}:\n{_tail(self.run_dir / f'{self.peer}.log')}") from None
        return time.monotonic() - t0

    def stop(self) -> bool:
        return True if self.proc is None else process_group.stop(self.proc, self.stop_timeout_s)


def make(cfg: Config, port: int, model: str, run_dir: Path, stop_timeout_s: float = 30.0,
         root: Path = ROOT) -> PdStart | Peer:
    """The server for `cfg` on 127.0.0.1:`port` (`model`: "" for each script's default; `root`:
    the checkout whose pd_start.sh starts it)."""
    if cfg.peer:
        return Peer(cfg.peer, port, model, run_dir, stop_timeout_s)
    return PdStart(cfg, port, model, run_dir, Path(cfg.root) if cfg.root else root)
