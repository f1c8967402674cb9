"""Stop-sequence matching on streamed text, holding back any possible partial match."""

from __future__ import annotations


class StopMatcher:
    """Feed decoded text pieces; get back text that is safe to emit.

    Text that could be the start of a stop string is held back until it is
    known not to be one, so no part of a stop string ever reaches the client.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""
        self.is_stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Add `text`; return what can be emitted now. Sets `is_stopped` on a match."""
        if self.is_stopped:
            return ""
        buf = self._pending + text
        cut = self._first_match(buf)
        if cut is not None:
            self.is_stopped = True
            self._pending = ""
            return buf[:cut]
        keep = self._partial_suffix_len(buf)
        self._pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation: release whatever was held back."""
        out, self._pending = self._pending, ""
        return "" if self.is_stopped else out

    def _first_match(self, buf: str) -> int | None:
        """Where the stop string that is complete first (ends first; of those, the longest) starts.

        Generation stops as soon as a stop string is complete, so the one ending first wins,
        however the text was split into pieces: with stops "x" and "axa", "axa" gives "a".
        """
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
                self.matched = stop
        return best[1] if best else None

    def _partial_suffix_len(self, buf: str) -> int:
        # Longest suffix of buf that is a proper prefix of some stop string.
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
