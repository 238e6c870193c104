"""Incremental detokenization: one sequence's token ids in, safe text deltas out.

Each step decodes only a short window of ids (the vLLM/TGI prefix/read-offset
scheme), never the whole output:

    window = [context ids | pending ids]
              ^ already emitted, decoded once into `context_text`
    new_text = decode(window); delta = new_text[len(context_text):]

The context exists because a decode depends on its neighbours (SentencePiece
decoders strip the space of the first piece, a byte-level token may hold half
a character). When `new_text` ends in a complete character, the pending ids
become the next context and the older context is dropped, so the window stays
a few tokens long.

On top of that sits the stop-string check, which works on characters: text
that could still grow into a stop string is held back, and the output is cut
exactly where the first stop string completes.

NOTE (invalid byte streams): emitted text cannot be taken back, so where a
decoder rewrites earlier text after the fact the deltas may differ from one
decode of the whole output in how many U+FFFD they hold. Two such cases: ids
still pending after _MAX_PENDING steps are emitted with their U+FFFD; and
byte fallback (Gemma) decodes a run of byte tokens as a whole, so a valid
character followed by stray bytes turns into U+FFFD in a full decode, while
here the character was already emitted. Valid UTF-8 streams are unaffected.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode yields for incomplete bytes
# Prompt ids that seed the window, so the first output token decodes in context.
_PROMPT_CONTEXT = 5
# A valid stream completes a character within 4 byte tokens (plus skipped
# special tokens in between); past this many pending ids the bytes are invalid
# and are emitted as U+FFFD rather than held (and re-decoded) forever.
_MAX_PENDING = 8


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas for one sequence.

    Guarantees, for a valid UTF-8 stream:
    - no delta ends in a partial multi-byte character: text whose decode ends
      in U+FFFD waits for the ids that complete it;
    - the deltas plus `flush()` concatenate to decode(prompt tail + output)
      minus decode(prompt tail), which for the usual tokenizers is
      `tokenizer.decode(output_ids, skip_special_tokens=...)`;
    - stop strings are matched across token boundaries: a suffix of the text
      that is a proper prefix of some stop string is held back until it either
      completes a stop string or cannot; on a match the text is cut before the
      stop string (after it with include_stop_str_in_output) and nothing later
      is emitted. With several candidates, the one that completes first wins
      (ties: the one that starts first), so the cut does not depend on how the
      text was split into tokens.

    Decoding uses clean_up_tokenization_spaces=False: clean-up rewrites text
    across token boundaries and cannot be applied incrementally.
    Raises ValueError on an empty stop string.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output

        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])  # the window
        self._read = len(self._ids)  # window[:_read] is context, the rest pending
        self._context_text = self._decode(self._ids)
        if self._context_text.endswith(_REPLACEMENT):
            # NOTE: the prompt ends inside a character (ids given directly, or a
            # resumed sequence). Its last (at most 3) ids join the pending ones
            # so the character, once completed, is emitted whole instead of being
            # garbled. The price: an invalid byte ending the prompt is emitted as
            # a leading U+FFFD of the output.
            for read in range(len(self._ids) - 1, max(len(self._ids) - 4, -1), -1):
                text = self._decode(self._ids[:read])
                if not text.endswith(_REPLACEMENT):
                    self._read, self._context_text = read, text
                    break

        self._emitted: list[str] = []
        self._held = ""  # decoded text that could be the start of a stop string
        self._matched: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All decoded output text so far: what was emitted plus what is held back
        for a possible stop string (not an incomplete trailing character). After
        a stop match or flush() it is exactly the concatenation of the deltas."""
        return "".join(self._emitted) + self._held

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, from append() or flush()."""
        return self._matched

    def append(self, token_id: int) -> tuple[str, str | None]:
        """Feed one token; returns (text delta that is now safe to emit, matched
        stop string or None). After a match or flush(), raises RuntimeError."""
        if self._finished:
            raise RuntimeError("append() after the sequence finished (stop string or flush)")
        self._ids.append(token_id)
        new_text = self._decode(self._ids)
        pending = len(self._ids) - self._read
        if new_text == self._context_text:
            # The pending ids decode to nothing here (skipped special tokens):
            # drop them so a run of them cannot grow the window.
            del self._ids[self._read :]
            return "", None
        grew = len(new_text) > len(self._context_text)
        if (not grew or new_text.endswith(_REPLACEMENT)) and pending < _MAX_PENDING:
            return "", None  # incomplete character: wait for its remaining bytes
        delta = new_text[len(self._context_text) :]
        # The pending ids become the context; the old context is dropped.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        return self._emit(delta, final=False)

    def flush(self) -> str:
        """At finish (length/eos/abort): return all held-back text. An incomplete
        trailing character comes out as U+FFFD, as tokenizer.decode gives it.
        A stop string can still match here (held text completed by those last
        bytes); matched_stop then reports it. Idempotent; ends the sequence."""
        if self._finished:
            return ""
        new_text = self._decode(self._ids)
        tail = new_text[len(self._context_text) :]
        delta, _ = self._emit(tail, final=True)
        self._finished = True
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _emit(self, delta: str, *, final: bool) -> tuple[str, str | None]:
        # Invariant: no stop string starts inside already-emitted text (that
        # text was never a stop prefix), so `held + delta` is all we search.
        buf = self._held + delta
        cut, end, matched = -1, -1, None
        for s in self._stop:
            i = buf.find(s)
            if i >= 0 and (matched is None or i + len(s) < end or (i + len(s) == end and i < cut)):
                cut, end, matched = i, i + len(s), s
        if matched is not None:
            out = buf[: end if self._include_stop else cut]
            self._held, self._matched, self._finished = "", matched, True
        else:
            keep = 0 if final else self._stop_prefix_len(buf)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        if out:
            self._emitted.append(out)
        return out, matched

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
