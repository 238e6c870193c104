"""The router's native SSE sender (csrc/fanout/sse_fanout.c, a plain CPython extension: send_chunks
and a helper thread's post/collect), built with the C compiler by native/loader.py's load_c_module
when the router starts; pd_server/fanout.py uses it and falls back to os.writev without it."""
from __future__ import annotations

from native.loader import load_c_module

MODULE = "pdserve_sse_fanout"


def load():
    """Build (or find cached) and import the module. Raises RuntimeError where it cannot be built."""
    return load_c_module(MODULE, "fanout/sse_fanout.c")
