"""The router's /metrics around a benchmark run: prefix hit rate and per-phase time.

`scrape(url)` before and after a run, `diff(before, after)` -> `ServerDelta`:
  * prefix hit rate: d(pdserve_cached_prompt_tokens) / d(pdserve_prompt_tokens), the share of
    prompt tokens the ranks served from a prefix cache (device or host);
  * phase means: d(pdserve_phase_seconds_sum{phase}) / d(..._count{phase}), seconds per
    request in each phase (pd_server/metrics.py `phase_durations`: queue, prefill_wait,
    prefill; PD adds stage, admission_wait, transfer, first_decode; decode);
  * completion tokens per request, to spread the phases after the first token over the
    inter-token gaps;
  * prefix hit by tier: of the prompt tokens the ranks looked up in their host caches
    (pdserve_rank_host_cache_lookup_tokens; in PD decode ranks' handoff lookups count too), the
    share the host cache served and the share the L3 store did (pdserve_rank_kv_store_hit_tokens),
    and the KV bytes decode ranks pulled from prefill ranks per request (pdserve_rank_transfer_bytes).

A server without pdserve's counters but with vLLM's (`vllm:prefix_cache_queries_total` and
`vllm:prefix_cache_hits_total`, prompt tokens looked up in and found in its prefix cache) gets
its hit rate from those; phases stay empty.

Which phase dominates: TTFT is queue + prefill_wait + prefill (+ the router's own time);
the mean ITL of a request is (its time after the first token) / (output tokens - 1), and
that time is stage + admission_wait + transfer + first_decode + decode, so each of those
phases' share of the ITL is its mean over their sum.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

TTFT_PHASES = ("queue", "prefill_wait", "prefill")
ITL_PHASES = ("stage", "admission_wait", "transfer", "first_decode", "decode")
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Prometheus text format -> {(name, sorted labels): value}."""
    out: Samples = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or line.startswith("#"):
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def scrape(url: str, timeout_s: float = 10.0) -> Samples:
    r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
    r.raise_for_status()
    return parse(r.text)


def _total(s: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in s.items() if n == name and want <= set(lab))


@dataclass(frozen=True)
class ServerDelta:
    prompt_tokens: float
    cached_tokens: float
    completion_tokens: float
    finished: float  # requests with phase times (the `decode` phase count)
    phase_mean_s: dict[str, float]  # phase -> seconds per request that had it
    lookup_tokens: float = 0.0  # prompt tokens the ranks looked up in their host caches
    host_hit_tokens: float = 0.0  # of those, served from the host cache (L3 reads included)
    l3_hit_tokens: float = 0.0  # of those, read from the L3 store first
    transfer_bytes: float = 0.0  # KV decode ranks pulled from prefill ranks

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def host_hit_rate(self) -> float | None:
        """Of the tokens looked up, those the host cache had (not read from the L3 first)."""
        return (self.host_hit_tokens - self.l3_hit_tokens) / self.lookup_tokens if self.lookup_tokens else None

    @property
    def l3_hit_rate(self) -> float | None:
        return self.l3_hit_tokens / self.lookup_tokens if self.lookup_tokens else None

    @property
    def kv_mib_per_request(self) -> float | None:
        return self.transfer_bytes / self.finished / 2**20 if self.finished else None

    @property
    def mean_output_tokens(self) -> float | None:
        return self.completion_tokens / self.finished if self.finished else None

    def dominant(self, phases: tuple[str, ...]) -> tuple[str, float] | None:
        """(phase, its share of the sum of `phases`' means) for the largest; None without data."""
        means = {p: self.phase_mean_s[p] for p in phases if p in self.phase_mean_s}
        total = sum(means.values())
        if not means or total <= 0:
            return None
        top = max(means, key=means.__getitem__)
        return top, means[top] / total

    def itl_share_ms(self) -> dict[str, float]:
        """Each post-first-token phase's contribution to the mean ITL, in ms per token."""
        n = self.mean_output_tokens
        if not n or n <= 1:
            return {}
        return {p: self.phase_mean_s[p] * 1000 / (n - 1) for p in ITL_PHASES if p in self.phase_mean_s}

    def to_json(self) -> dict:
        ttft, itl = self.dominant(TTFT_PHASES), self.dominant(ITL_PHASES)
        return {"prompt_tokens": self.prompt_tokens, "cached_prompt_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "prefix_hit_rate": self.prefix_hit_rate,
                "host_hit_rate": self.host_hit_rate, "l3_hit_rate": self.l3_hit_rate,
                "kv_mib_per_request": self.kv_mib_per_request,
                "phase_mean_ms": {p: v * 1000 for p, v in self.phase_mean_s.items()},
                "itl_phase_ms_per_token": self.itl_share_ms(),
                "ttft_dominant_phase": ttft[0] if ttft else None, "ttft_dominant_share": ttft[1] if ttft else None,
                "itl_dominant_phase": itl[0] if itl else None, "itl_dominant_share": itl[1] if itl else None}


def diff(before: Samples, after: Samples) -> ServerDelta:
    """What happened on the server between two scrapes."""
    def d(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    phases = {lab[1] for (n, labs), _ in after.items() if n == "pdserve_phase_seconds_count"
              for lab in labs if lab[0] == "phase"}
    means = {}
    for p in sorted(phases):
        count = d("pdserve_phase_seconds_count", phase=p)
        if count > 0:
            means[p] = d("pdserve_phase_seconds_sum", phase=p) / count
    prompt, cached = d("pdserve_prompt_tokens_total"), d("pdserve_cached_prompt_tokens_total")
    if not any(n == "pdserve_prompt_tokens_total" for n, _ in after):
        prompt, cached = d("vllm:prefix_cache_queries_total"), d("vllm:prefix_cache_hits_total")
    return ServerDelta(prompt_tokens=prompt, cached_tokens=cached,
                       completion_tokens=d("pdserve_completion_tokens_total"),
                       finished=d("pdserve_phase_seconds_count", phase="decode"), phase_mean_s=means,
                       lookup_tokens=d("pdserve_rank_host_cache_lookup_tokens"),
                       host_hit_tokens=d("pdserve_rank_host_cache_hit_tokens"),
                       l3_hit_tokens=d("pdserve_rank_kv_store_hit_tokens"),
                       transfer_bytes=d("pdserve_rank_transfer_bytes"))
