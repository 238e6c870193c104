"""One aiperf run against a live server, with the server's /metrics scraped before and after.

    m = measure.run(url, cmd, artifact_dir, timeout_s)   # cmd: aiperf_client.agentx_cmd / synthetic_cmd
    m.ok, m.client (aiperf_client.Result), m.server (server_metrics.ServerDelta), m.error

Used by bench/agentx/compare.py (AgentX replay per configuration), bench/agentx/serve_bench.py
(one synthetic level) and bench/mission (both, per configuration). A server without a
readable /metrics still gets its client numbers: `server` is None and `metrics_error` says why.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.agentx import aiperf_client, server_metrics


@dataclass(frozen=True)
class Measured:
    rc: int  # aiperf's exit code (124: killed at the timeout)
    client: aiperf_client.Result | None  # None when aiperf wrote no summary
    server: server_metrics.ServerDelta | None  # None when a /metrics scrape failed
    metrics_error: str | None
    artifact_dir: Path

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.client is not None

    @property
    def error(self) -> str | None:
        if self.rc != 0:
            return f"aiperf exited with {self.rc} (see {self.artifact_dir / 'aiperf.log'})"
        if self.client is None:
            return f"aiperf wrote no {aiperf_client.SUMMARY} in {self.artifact_dir}"
        return None

    def to_json(self) -> dict:
        return {"ok": self.ok, "rc": self.rc, "error": self.error, "metrics_error": self.metrics_error,
                "artifact_dir": str(self.artifact_dir.resolve()),
                "client": self.client.to_json() if self.client else None,
                "server": self.server.to_json() if self.server else None}


def _scrape(url: str) -> tuple[server_metrics.Samples | None, str | None]:
    try:
        return server_metrics.scrape(url), None
    except (httpx.HTTPError, ValueError) as e:
        return None, f"/metrics: {type(e).__name__}: {e}"


def run(url: str, cmd: list[str], artifact_dir: Path, timeout_s: float) -> Measured:
    """Scrape `url`/metrics, run aiperf `cmd` (its console in `artifact_dir`/aiperf.log, killed
    after `timeout_s`), scrape again, read aiperf's export."""
    artifact_dir.mkdir(parents=True, exist_ok=True)
    (artifact_dir / "aiperf_command.txt").write_text(" ".join(cmd) + "\n")
    before, err = _scrape(url)
    rc = aiperf_client.run(cmd, artifact_dir, timeout_s=timeout_s)
    after, err_after = _scrape(url)
    server = server_metrics.diff(before, after) if before is not None and after is not None else None
    client = aiperf_client.load_result(artifact_dir) if (artifact_dir / aiperf_client.SUMMARY).exists() else None
    return Measured(rc=rc, client=client, server=server, metrics_error=err or err_after, artifact_dir=artifact_dir)
