"""Tool calls out of generated text: Hermes `<tool_call>{json}</tool_call>` blocks, or a bare JSON call.

One incremental parser serves streaming and non-streaming responses (non-streaming feeds
the whole text at once), so both give the same calls:
  * text state: text is content, except a suffix that could be the start of `<tool_call>`
    (held back until it is or cannot be) and leading whitespace (held until the first
    visible character decides the mode);
  * call state: after `<tool_call>`, text is buffered until `</tool_call>` (or the end),
    then parsed as one or more JSON objects {"name": ..., "arguments"|"parameters": ...}
    (one missing closing brace is forgiven); a block that does not parse is given back as
    content, tags included;
  * bare state: when the output's first visible character opens JSON (`{`, `[`, or a
    ```json fence), everything is held to the end and parsed as calls whose names must be
    among the request's tools; otherwise it is content after all.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


def _calls_from_json(text: str, names: frozenset[str] | None) -> list[ParsedToolCall] | None:
    """Parse one or more JSON calls (objects or lists of objects, separated by whitespace or
    commas). None when the text is not entirely calls; with `names`, every call's name must
    be one of them."""
    dec, pos, calls = json.JSONDecoder(), 0, []
    text = text.strip()
    while pos < len(text):
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            call = _one_call(item, names)
            if call is None:
                return None
            calls.append(call)
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
    return calls or None


def _one_call(obj, names: frozenset[str] | None) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
    else:
        args = json.dumps(args, ensure_ascii=False)
    return ParsedToolCall(obj["name"], args)


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


class ToolCallParser:
    """Incremental: feed() text deltas, then finish(); each returns (content delta, new calls)."""

    def __init__(self, tool_names: list[str], prefix: str = "") -> None:
        self._names = frozenset(tool_names)
        self._state = "start"  # start | text | call | bare
        self._buf = ""
        self.num_calls = 0
        self._pending = prefix  # forced prefix: text the prompt already put in the model's mouth
        self._ws = ""  # held whitespace tail (see _whitespace)
        self._after_call = False

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        if self._pending:
            delta, self._pending = self._pending + delta, ""
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        if self._pending:
            self._buf, self._pending = self._buf + self._pending, ""
        return self._advance(final=True)

    def feed_event(self, text: str, last: bool) -> tuple[str, list[ParsedToolCall]]:
        """A stream's event: feed(text), then finish() when it is the request's last."""
        out, calls = self.feed(text)
        if last:
            t2, c2 = self.finish()
            out, calls = out + t2, calls + c2
        return out, calls

    def _advance(self, final: bool) -> tuple[str, list[ParsedToolCall]]:
        pieces: list[str | ParsedToolCall] = []  # content and calls, in output order
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if not stripped:
                    if final:
                        pieces.append(self._buf)
                        self._buf = ""
                    break
                self._state = "bare" if stripped[0] in "{[`" and self._names else "text"
            if self._state == "bare":
                if not final:
                    break
                found = _calls_from_json(self._unfence(self._buf), self._names)
                if found is None:
                    pieces.append(self._buf)
                else:
                    pieces += found
                self._buf = ""
                break
            if self._state == "text":
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self._buf, OPEN)
                    pieces.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                pieces.append(self._buf[:i])
                self._buf, self._state = self._buf[i + len(OPEN):], "call"
            if self._state == "call":
                j = self._buf.find(CLOSE)
                if j < 0 and not final:
                    break
                body = self._buf if j < 0 else self._buf[:j]
                # NOTE: small models often drop the call object's closing brace after the
                # arguments object; one missing "}" is repaired.
                found = _calls_from_json(body, None) or _calls_from_json(body.rstrip() + "}", None)
                if found is None:
                    pieces.append(OPEN + body + ("" if j < 0 else CLOSE))
                else:
                    pieces += found
                self._buf = "" if j < 0 else self._buf[j + len(CLOSE):]
                self._state = "text"
                if j < 0:
                    break
        return self._whitespace(pieces, final)

    def _whitespace(self, pieces: list, final: bool) -> tuple[str, list[ParsedToolCall]]:
        """Whitespace next to a call is not content: a whitespace tail is held until text
        follows (emitted) or a call does (dropped); text right after a call loses its leading
        whitespace; at the end the tail is emitted only when there were no calls. Without
        calls the content is therefore the text exactly, however it was split."""
        out, calls = [], []
        for piece in pieces:
            if isinstance(piece, ParsedToolCall):
                calls.append(piece)
                self._ws, self._after_call = "", True
                continue
            if self._after_call:
                piece = piece.lstrip()
                if not piece:
                    continue
                self._after_call = False
            text = self._ws + piece
            body = text.rstrip()
            self._ws = text[len(body):]
            out.append(body)
        self.num_calls += len(calls)
        if final:
            if not self.num_calls:
                out.append(self._ws)
            self._ws = ""
        return "".join(out), calls

    @staticmethod
    def _unfence(text: str) -> str:
        m = _FENCE.match(text.strip())
        return m.group(1) if m else text


def parse_tool_calls(text: str, tool_names: list[str], prefix: str = "") -> tuple[str | None, list[ParsedToolCall]]:
    """Whole-text form: (content, calls); content None when there are calls and no other text."""
    p = ToolCallParser(tool_names, prefix)
    c1, k1 = p.feed(text)
    c2, k2 = p.finish()
    content, calls = c1 + c2, k1 + k2
    return (content or None) if calls else content, calls
