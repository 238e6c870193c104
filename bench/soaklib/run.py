"""The soak itself, against a system at a URL:

  1. read /health (ranks, their pids, the model, its context) and the router's request counter;
     the router's pid is the one given, else the parent the ranks share;
  2. for `minutes`, `concurrency` workers each send the next request of the mix (mix.py) and
     wait for its outcome (client.py); a sampler records every process's memory and every
     rank's /health entry each `sample_s`;
  3. wait (up to `quiet_timeout_s`) until every rank is idle (system.py says what idle is),
     take a last sample and the request counter again;
  4. `SoakResult.failures` judges: no unexpected outcome, every request sent was answered by
     the router (its counter moved by exactly as many), ranks idle and alive under the same
     pids, and no process's private RSS grew by more than `rss_growth_mb` between the first
     sample after the warm-up and the last.
A URL under soak must carry no other traffic, or the request count cannot match.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from cluster.cli_args import opt

from .client import Outcome, execute
from .mix import RequestMix, Spec
from .system import Memory, api_request_count, busy_fields, memory, router_pid


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = opt(3.0, "minutes of load")
    concurrency: int = opt(8, "requests in flight at once (one per client worker)")
    seed: int = opt(0, "seed of the request mix")
    max_tokens: int = opt(48, "normal requests ask for max_tokens in [1, this]")
    stop_frac: float = opt(0.25, "fraction of normal requests with stop strings (0 for --fake-ranks: they "
                                 "ignore stop strings)")
    disconnect_frac: float = opt(0.08, "fraction of requests: streams the client closes after 1-8 events")
    abort_frac: float = opt(0.05, "fraction of requests: long requests the client closes after 0.1-2 s")
    invalid_frac: float = opt(0.07, "fraction of requests: invalid ones that must get a 4xx")
    request_timeout_s: float = opt(120.0, "a request not ended by then counts as an unexpected timeout")
    sample_s: float = opt(5.0, "seconds between samples of memory and rank load")
    warmup_s: float = opt(-1.0, "RSS growth counts from the first sample past this (< 0: 20%% of the run, "
                                "at most 60 s)")
    quiet_timeout_s: float = opt(60.0, "after the load, how long ranks get to become idle")
    rss_growth_mb: float = opt(256.0, "fail when a process's private RSS grows more than this after warm-up")
    api_key: str = opt("", "sent as Authorization: Bearer on every request when set")

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.concurrency < 1 or self.sample_s <= 0 or self.max_tokens < 1:
            raise ValueError("need minutes > 0, concurrency >= 1, sample_s > 0, max_tokens >= 1")

    @property
    def duration_s(self) -> float:
        return self.minutes * 60

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s >= 0 else min(60.0, 0.2 * self.duration_s)


@dataclass
class Sample:
    t: float  # seconds since the load started
    memory: dict[str, Memory]  # process name ("router", rank names) -> memory; gone processes missing
    ranks: dict[str, dict]  # rank name -> its /health entry (empty when /health did not answer)


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # label -> count
    unexpected: Counter = field(default_factory=Counter)  # label -> count, unexpected labels only
    faults: Counter = field(default_factory=Counter)  # spec kind -> count, fault specs only
    details: dict[str, list[str]] = field(default_factory=dict)  # unexpected label -> first few details
    tokens: int = 0  # completion tokens of ok requests
    started: int = 0
    finished: int = 0

    def record(self, spec: Spec, out: Outcome) -> None:
        self.finished += 1
        self.outcomes[out.label] += 1
        if spec.fault:
            self.faults[spec.kind] += 1
        if out.unexpected:
            self.unexpected[out.label] += 1
            self.details.setdefault(out.label, [])
            if len(self.details[out.label]) < 3:
                self.details[out.label].append(out.detail)
        elif out.label == "ok":
            self.tokens += out.tokens


@dataclass
class SoakResult:
    config: SoakConfig
    url: str
    pids: dict[str, int]  # process name -> pid, at the start
    tally: Tally
    samples: list[Sample]
    load_s: float
    quiet_s: float | None  # seconds from the end of the load to all ranks idle; None: not within the timeout
    busy: dict[str, dict]  # rank name -> what kept it from idle at the end
    router_counted: int | None  # API requests the router answered during the soak; None: /metrics did not answer

    @property
    def warm_sample(self) -> Sample:
        return next((s for s in self.samples[:-1] if s.t >= self.config.warmup), self.samples[-2])

    def rss_growth(self) -> dict[str, float]:
        """Private RSS growth (MiB) per process, last sample minus the first one past warm-up."""
        warm, end = self.warm_sample.memory, self.samples[-1].memory
        return {p: end[p].private_mb - warm[p].private_mb for p in self.pids if p in warm and p in end}

    @property
    def failures(self) -> list[str]:
        out, t = [], self.tally
        if t.unexpected:
            out.append(f"{sum(t.unexpected.values())} unexpected outcome(s): {dict(t.unexpected)}")
        if t.started != t.finished:
            out.append(f"{t.started} requests started, {t.finished} finished")
        if not t.outcomes["ok"]:
            out.append("no request succeeded")
        if self.router_counted != t.finished:
            out.append(f"the router answered {self.router_counted} API requests, the client sent {t.finished}")
        if self.busy:
            out.append(f"ranks not idle {self.config.quiet_timeout_s:.0f}s after the load: {self.busy}")
        end = self.samples[-1].ranks
        for name, pid in self.pids.items():
            if name != "router" and end.get(name, {}).get("pid") != pid:
                out.append(f"{name} (pid {pid}) is gone or restarted: {end.get(name)}")
            if name not in self.samples[-1].memory:
                out.append(f"{name} (pid {pid}) exited")
        for name, grew in self.rss_growth().items():
            if grew > self.config.rss_growth_mb:
                out.append(f"{name} private RSS grew {grew:.0f} MiB after warm-up "
                           f"(limit {self.config.rss_growth_mb:.0f})")
        return out


async def soak(url: str, cfg: SoakConfig, pid_of_router: int | None = None,
               progress: Callable[[str], None] | None = None) -> SoakResult:
    """Run the soak against the system at url (see the module docstring); never raises for what
    the system does, only for a system that is not healthy at the start (RuntimeError)."""
    auth = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 2, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(headers=auth, timeout=10) as probe, \
            httpx.AsyncClient(headers=auth, limits=limits, timeout=httpx.Timeout(cfg.request_timeout_s)) as load:
        try:
            r = await probe.get(url + "/health")
        except httpx.HTTPError as e:
            raise RuntimeError(f"{url}/health: {e}") from e
        if r.status_code != 200:
            raise RuntimeError(f"{url}/health answered {r.status_code}: {r.text[:300]}")
        health = r.json()
        # Only the ranks live now are watched: a rank that died before the soak (a shared test
        # system whose earlier tests killed one) is not this run's finding.
        pids = {rk["name"]: rk["pid"] for rk in health["ranks"] if rk.get("state") == "ready"}
        if not pids:
            raise RuntimeError(f"{url}/health lists no ready rank: {health['ranks']}")
        rpid = pid_of_router or router_pid(list(pids.values()))
        pids = {"router": rpid, **pids} if rpid else pids
        counted_before = await _api_requests(probe, url)
        if counted_before is None:
            raise RuntimeError(f"{url}/metrics did not answer")
        mix = RequestMix(random.Random(cfg.seed), health["model"], health["max_model_len"], cfg.max_tokens,
                         cfg.stop_frac, cfg.disconnect_frac, cfg.abort_frac, cfg.invalid_frac)
        tally = Tally()
        t0 = time.monotonic()
        samples = [await _sample(probe, url, pids, t0)]
        deadline = t0 + cfg.duration_s

        async def worker() -> None:
            while time.monotonic() < deadline:
                spec = mix.next()
                tally.started += 1
                try:
                    out = await execute(load, url, spec, cfg.request_timeout_s)
                except Exception as e:  # noqa: BLE001 - a bug here must show as an error, not end the soak
                    out = Outcome(f"client_bug:{type(e).__name__}", True, detail=repr(e)[:300])
                tally.record(spec, out)

        async def sampler() -> None:
            while True:
                await asyncio.sleep(cfg.sample_s)
                samples.append(s := await _sample(probe, url, pids, t0))
                if progress:
                    progress(_progress_line(s, tally))

        sampling = asyncio.create_task(sampler())
        try:
            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
            load_s = time.monotonic() - t0
            quiet_s, busy = await _wait_quiet(probe, url, cfg.quiet_timeout_s, set(pids) - {"router"})
        finally:
            sampling.cancel()
        samples.append(await _sample(probe, url, pids, t0))
        counted = await _api_requests(probe, url)
        counted = None if counted is None else counted - counted_before
    return SoakResult(cfg, url, pids, tally, samples, load_s, quiet_s, busy, counted)


async def _api_requests(probe: httpx.AsyncClient, url: str) -> int | None:
    try:
        r = await probe.get(url + "/metrics")
        return api_request_count(r.text) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def _health_ranks(probe: httpx.AsyncClient, url: str) -> dict[str, dict]:
    try:
        return {rk["name"]: rk for rk in (await probe.get(url + "/health")).json()["ranks"]}
    except (httpx.HTTPError, ValueError, KeyError):
        return {}


async def _sample(probe: httpx.AsyncClient, url: str, pids: dict[str, int], t0: float) -> Sample:
    ranks = await _health_ranks(probe, url)
    mem = {name: m for name, pid in pids.items() if (m := memory(pid)) is not None}
    return Sample(round(time.monotonic() - t0, 1), mem, ranks)


async def _wait_quiet(probe: httpx.AsyncClient, url: str, timeout_s: float,
                      names: set[str]) -> tuple[float | None, dict]:
    """(seconds until every rank in `names` was idle, {}) or (None, what was still busy at the
    timeout). Idle must hold twice in a row: rank stats lag the router by up to a heartbeat."""
    t0, streak, busy = time.monotonic(), 0, {}
    while time.monotonic() - t0 < timeout_s:
        ranks = await _health_ranks(probe, url)
        busy = ({n: b for n, rk in ranks.items() if n in names and (b := busy_fields(rk))} if ranks
                else {"health": "no answer"})
        streak = 0 if busy else streak + 1
        if streak == 2:
            return round(time.monotonic() - t0, 1), {}
        await asyncio.sleep(0.5)
    return None, busy


def _progress_line(s: Sample, tally: Tally) -> str:
    pages = " ".join(f"{n}:{rk.get('pages_used')}/{rk.get('inflight')}" for n, rk in s.ranks.items())
    rss = " ".join(f"{n}:{m.private_mb:.0f}" for n, m in s.memory.items())
    return (f"t={s.t:>6.0f}s  sent {tally.started}  ok {tally.outcomes['ok']}  unexpected "
            f"{sum(tally.unexpected.values())}  pages/inflight {pages}  private RSS MiB {rss}")
