"""The serving configurations of a mission run, by name.

    parse_configs("2P2D,1P1D,colocated-2,vllm,llamacpp", ["2P2D-big=--prefill 2 --decode 2 --max-num-seqs 64"])

Built-in names (case-insensitive):
  * `xPyD`          -> scripts/pd_start.sh --prefill x --decode y
  * `colocated-N`   -> scripts/pd_start.sh --colocated N
  * either with suffixes `-nolend` (--no-lend-cores), `-shm` / `-nixl` (--transfer shm|nixl),
    e.g. `2P2D-nolend`;
  * `vllm`          -> scripts/peer_vllm.sh serve (only where `.venv-vllm` exists);
  * `llamacpp`      -> scripts/peer_llamacpp.sh serve (only where its setup has built llama-server).
`NAME=FLAGS` (the --config flag) defines NAME as pd_start.sh FLAGS (shell words); a defined
name wins over a built-in one and is run after the --configs list if that does not name it.
Leading `VAR=value` words are set in pd_start.sh's environment, as in a shell (e.g.
`slow=PDSERVE_FAULT=prefill-0:slow_kv_store:0.05 --prefill 1 --decode 1 --kv-store file:/tmp/s`).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

VLLM, LLAMACPP = "vllm", "llamacpp"
PEERS = (VLLM, LLAMACPP)  # other servers, each started by scripts/peer_<name>.sh serve
SUFFIXES = {"nolend": ("--no-lend-cores",), "shm": ("--transfer", "shm"), "nixl": ("--transfer", "nixl")}
_PD = re.compile(r"^(\d+)p(\d+)d$")
_COLOCATED = re.compile(r"^colocated-(\d+)$")
# Flags the harness sets itself for every start.
_RESERVED = ("--port", "--host")


@dataclass(frozen=True)
class Config:
    name: str
    flags: tuple[str, ...] = ()  # scripts/pd_start.sh flags; empty for a peer
    env: tuple[tuple[str, str], ...] = ()  # set in pd_start.sh's environment
    root: str = ""  # the checkout whose pd_start.sh starts it ("": this one; a baseline's: another)
    peer: str = ""  # one of PEERS: started with scripts/peer_<peer>.sh serve instead


def builtin(name: str) -> Config:
    """The Config a built-in name stands for; ValueError for any other name."""
    base, *suffixes = name.lower().split("-")
    if base == "colocated" and suffixes:  # "colocated-2[-nolend]": the count is part of the base
        base = f"colocated-{suffixes.pop(0)}"
    if base in PEERS and not suffixes:
        return Config(name, peer=base)
    if m := _PD.match(base):
        flags: tuple[str, ...] = ("--prefill", m.group(1), "--decode", m.group(2))
    elif m := _COLOCATED.match(base):
        flags = ("--colocated", m.group(1))
    else:
        raise ValueError(f"unknown config {name!r}: use xPyD, colocated-N, {', '.join(PEERS)} (suffixes "
                         f"{', '.join('-' + s for s in SUFFIXES)}) or define it with --config NAME='FLAGS'")
    if "0" in flags[1::2]:
        raise ValueError(f"config {name!r}: rank counts must be positive")
    for s in suffixes:
        if s not in SUFFIXES:
            raise ValueError(f"config {name!r}: unknown suffix -{s} (known: {', '.join(SUFFIXES)})")
        flags += SUFFIXES[s]
    return Config(name, flags)


def defined(spec: str) -> Config:
    """`NAME=pd_start flags` -> Config (ValueError if malformed or it sets --port/--host)."""
    name, sep, flags = spec.partition("=")
    name = name.strip()
    if not sep or not name or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        raise ValueError(f"--config {spec!r}: expected NAME='pd_start.sh flags', NAME of letters, digits, _.+-")
    words = tuple(shlex.split(flags))
    env = []
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0], re.S):
        var, _, value = words[0].partition("=")
        env.append((var, value))
        words = words[1:]
    if not words:
        raise ValueError(f"--config {spec!r}: no flags")
    if bad := [w for w in words if w.split("=")[0] in _RESERVED]:
        raise ValueError(f"--config {spec!r}: {bad[0]} is set by the harness (use --port)")
    return Config(name, words, env=tuple(env))


def parse_configs(names: str, specs: list[str]) -> list[Config]:
    """The configurations to run, in order: `names` (comma list) then any --config `specs`
    not named there. ValueError on an unknown or repeated name."""
    listed = [n.strip() for n in names.split(",") if n.strip()]
    custom: dict[str, Config] = {}
    for c in map(defined, specs):
        if c.name.lower() in custom:
            raise ValueError(f"--config {c.name!r} defined twice")
        custom[c.name.lower()] = c
    if dup := sorted({n for n in listed if [m.lower() for m in listed].count(n.lower()) > 1}):
        raise ValueError(f"config {dup[0]!r} named twice")
    out = [custom.pop(n.lower(), None) or builtin(n) for n in listed]
    return out + list(custom.values())


def baseline_configs(spec: str) -> list[Config]:
    """`DIR:NAME,NAME` -> those built-in or --config-less names started from the checkout at DIR
    (a `git worktree` of an earlier commit whose .venv links to this one's), named NAME@base:
    a before/after in one run. ValueError when DIR is not a checkout with scripts/pd_start.sh."""
    from dataclasses import replace
    from pathlib import Path

    where, _, names = spec.partition(":")
    root = Path(where).expanduser().resolve()
    if not (root / "scripts" / "pd_start.sh").is_file():
        raise ValueError(f"--baseline {spec!r}: {root} has no scripts/pd_start.sh")
    return [replace(c, name=c.name + "@base", root=str(root)) for c in parse_configs(names, [])]
