"""Generated token ids → text deltas, with stop strings.

Byte-level BPE can split one character over several tokens: a delta is held back while the
text ends in an incomplete character (U+FFFD), and while it could still be the start of a
stop string. When a stop string appears, the text ends before it and the request stops.

    stream = TextStream(decode, stop=("\\n\\n",))
    delta = stream.push(token_ids)     # new text that is safe to send
    if stream.stopped: ...              # a stop string was seen: abort the engine request
    rest = stream.finish()             # at the end: whatever was held back
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """Invariant: `sent` is a prefix of the final text; nothing after a stop string is ever sent."""

    def __init__(self, decode: Callable[[Sequence[int]], str] | None, stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self._done = ""        # text of ids[:self._done_ids], which ends on a whole character
        self._done_ids = 0
        self.sent = 0
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; the text delta now safe to send."""
        if self.stopped or not token_ids:
            return ""
        self.ids.extend(token_ids)
        if self.decode is None:
            return ""
        self.text = self._decode_tail()
        if self.stop:
            cut = self._find_stop()
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
                return self._emit(len(self.text))
        if self.text.endswith(REPLACEMENT):
            return ""
        return self._emit(len(self.text) - self.hold)

    def _decode_tail(self) -> str:
        """The whole text, decoding only the ids since the last whole character (byte-level BPE
        decodes a concatenation of ids to the concatenation of their bytes)."""
        assert self.decode is not None
        tail = self.decode(self.ids[self._done_ids:])
        if not tail.endswith(REPLACEMENT):
            self._done += tail
            self._done_ids = len(self.ids)
            return self._done
        return self._done + tail

    def finish(self) -> str:
        """The rest of the text, at the end of the request."""
        return self._emit(len(self.text))

    def _find_stop(self) -> int | None:
        start = max(self.sent - self.hold, 0)
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent:upto]
        self.sent = upto
        return delta
