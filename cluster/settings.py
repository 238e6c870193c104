"""Every PDSERVE_* environment variable the project reads, in one place, typed.

Flags are the interface; these few settings are what a flag cannot carry (a secret kept out of
`ps`, a directory every process shares, the node a Ray actor put a rank on) or what tests and
benchmarks set around the processes they start. Code reads them through the functions below,
never os.environ directly (tests/unit/cluster/test_settings.py checks both that and that
docs/operations.md's table lists exactly SETTINGS). Each is read when asked, so a test's
monkeypatch.setenv takes effect.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    what: str


CACHE_DIR = Setting("PDSERVE_CACHE_DIR", "~/.cache/pdserve",
                    "where converted models, tokenizers, built kernels and checkpoint digests (`digests/`) are kept")
KERNELS = Setting("PDSERVE_KERNELS", "native",
                  "`torch` runs the torch reference ops in place of the CPU kernels that have one "
                  "(linear, RMSNorm, activation, rotary, prefill attention, sampler), for parity checks")
API_KEY = Setting("PDSERVE_API_KEY", "", "the key /v1/* requests must carry (--api-key wins)")
CLUSTER_SECRET = Setting("PDSERVE_CLUSTER_SECRET", "",
                         "turns on CURVE on every rank socket (--cluster-secret wins; the launcher passes it "
                         "to the ranks in their environment)")
NODE = Setting("PDSERVE_NODE", "the hostname", "the node a rank reports in /health (set by the Ray actor)")
FAULT = Setting("PDSERVE_FAULT", "", "fault injection for tests: `<rank>:<fault>[:<seconds>],...` "
                "(rank_runtime/faults.py); never set in production")
TEST_DEVICE = Setting("PDSERVE_TEST_DEVICE", "cpu", "the device the model tests run on (scripts/gpu_check.sh: cuda)")
AIPERF_SERVER_METRICS = Setting("PDSERVE_AIPERF_SERVER_METRICS", "0",
                                "`1` lets aiperf scrape the server's /metrics during a replay (off: it perturbs "
                                "the run)")
STEP_LOG = Setting("PDSERVE_STEP_LOG", "", "a directory: every rank appends a line per engine step to "
                   "`<role>-<index>-<pid>.steps` there (rank_runtime/step_log.py; bench/step_log.py reads them); "
                   "for diagnosis, unset in production")
SETTINGS = (CACHE_DIR, KERNELS, API_KEY, CLUSTER_SECRET, NODE, FAULT, TEST_DEVICE, AIPERF_SERVER_METRICS, STEP_LOG)


def _get(s: Setting, environ: Mapping[str, str] | None = None) -> str:
    return (os.environ if environ is None else environ).get(s.name, "")


def cache_dir() -> Path:
    """Root of the on-disk caches: $PDSERVE_CACHE_DIR, else ~/.cache/pdserve."""
    return Path(_get(CACHE_DIR) or Path.home() / ".cache" / "pdserve")


def private_dir(path: Path, create: bool = True) -> Path:
    """`path`, made (mode 0700) where missing (`create`; else FileNotFoundError); RuntimeError
    unless it is a directory this user owns that no one else may write to: code and weights
    are loaded from it."""
    import stat

    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{path} is not a directory of this user's that only it may write to (owner uid "
                           f"{st.st_uid}, mode {stat.filemode(st.st_mode)}): refusing to load from it")
    return path


def step_log_dir() -> Path | None:
    """$PDSERVE_STEP_LOG as a directory, or None when unset."""
    v = _get(STEP_LOG)
    return Path(v).expanduser() if v else None


def kernels() -> Literal["native", "torch"]:
    """Which ops run where both exist: the CPU kernels (default) or torch's. Raises ValueError
    on another value, so a typo is not a silent comparison run."""
    v = _get(KERNELS) or "native"
    if v not in ("native", "torch"):
        raise ValueError(f"{KERNELS.name} must be 'native' or 'torch', got {v!r}")
    return v  # type: ignore[return-value]


def api_key(environ: Mapping[str, str] | None = None) -> str:
    return _get(API_KEY, environ)


def cluster_secret() -> str:
    return _get(CLUSTER_SECRET)


def node() -> str:
    """"" when unset (the caller uses the hostname)."""
    return _get(NODE)


def fault_spec() -> str:
    return _get(FAULT)


def device_under_test() -> str:
    return _get(TEST_DEVICE) or "cpu"


def aiperf_server_metrics() -> bool:
    return _get(AIPERF_SERVER_METRICS) == "1"


def packing_identity() -> str:
    """The settings a CPU rank's packed weights depend on (engine/shared_weights.py hashes it)."""
    return f"kernels={kernels()}"
