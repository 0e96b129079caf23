"""Stop strings matched on streamed text, across token boundaries.

Text that could be the start of a stop string is held back until it is known not to be one,
so a streaming client never sees part of a stop string (unless it asked for the stop string
to be included, in which case nothing needs holding back).
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str], include_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_in_output = include_in_output
        self._longest = max((len(s) for s in self.stop), default=0)
        self._held = ""  # text not yet released
        self._tail = ""  # end of released text where a stop string may begin (include mode)

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add decoded text; return (text to release now, the stop string hit or None).

        After a hit the released text ends before the stop string (or after it, when it is
        included) and everything after it is dropped.
        """
        if not self.stop:
            return text, None
        window = self._tail + self._held + text
        hit = self._find(window)
        if hit is not None:
            pos, stop = hit
            end = pos + len(stop) if self.include_in_output else pos
            released = window[len(self._tail) : end]
            self._held = self._tail = ""
            return released, stop
        keep = 0 if self.include_in_output else self._partial_suffix(window)
        released = window[len(self._tail) : len(window) - keep]
        self._held = window[len(window) - keep :]
        if self.include_in_output and self._longest > 1:
            self._tail = (self._tail + released)[-(self._longest - 1) :]
        return released, None

    def flush(self) -> str:
        """Release what is held back (the generation ended without a stop string)."""
        held, self._held = self._held, ""
        return held

    def _find(self, window: str) -> tuple[int, str] | None:
        """The stop string that completes first (then the one that starts first), so that the
        result does not depend on how the text was cut into pieces."""
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            pos = window.find(stop)
            if pos >= 0 and (best is None or (pos + len(stop), pos) < best[:2]):
                best = (pos + len(stop), pos, stop)
        return None if best is None else (best[1], best[2])

    def _partial_suffix(self, window: str) -> int:
        """Length of the longest end of `window` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stop:
            # Candidate starts are occurrences of the stop string's first character.
            i = window.find(stop[0], max(len(window) - len(stop) + 1, 0))
            while i != -1 and len(window) - i > best:
                if stop.startswith(window[i:]):
                    best = len(window) - i
                    break
                i = window.find(stop[0], i + 1)
        return best
