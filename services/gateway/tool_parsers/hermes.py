"""Hermes-style tool calls, as Qwen2.5/Qwen3 and Hermes models write them:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

Text outside the blocks is content; whitespace next to a block is dropped. A block that is not
a call (bad JSON, no name) stays content, tags included. A block cut short by the end of the
output is parsed as if closed there.
"""

from __future__ import annotations

from services.gateway.tool_calls import CallScanner, ParsedDelta


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""  # text not parsed yet (a possible start of a tag)
        self._call: CallScanner | None = None  # the block being read
        self._whitespace = ""  # held: dropped if a call follows
        self._after_call = False  # whitespace right after a call is dropped
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += text
        while True:
            tag = self.START if self._call is None else self.END
            pos = self._buffer.find(tag)
            if pos < 0:
                cut = len(self._buffer) - _partial_suffix(self._buffer, tag)
                self._consume(out, self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                return out
            self._consume(out, self._buffer[:pos])
            self._buffer = self._buffer[pos + len(tag) :]
            if self._call is None:
                self._whitespace = ""
                self._call = CallScanner(self.num_calls)
            else:
                self._close_call(out, closed=True)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._consume(out, self._buffer)
        self._buffer = ""
        if self._call is not None:
            self._close_call(out, closed=False)
        if not self.num_calls:
            out.content += self._whitespace
        self._whitespace = ""
        return out

    def _consume(self, out: ParsedDelta, text: str) -> None:
        if self._call is not None:
            out.calls.extend(self._call.feed(text))
        else:
            self._content(out, text)

    def _close_call(self, out: ParsedDelta, *, closed: bool) -> None:
        assert self._call is not None
        is_call, deltas = self._call.close()
        body = self._call.body
        self._call = None
        if is_call:
            out.calls.extend(deltas)
            self.num_calls += 1
            self._after_call = True
        else:
            self._content(out, self.START + body + (self.END if closed else ""))

    def _content(self, out: ParsedDelta, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        kept = text.rstrip()
        if not kept:
            self._whitespace += text
            return
        out.content += self._whitespace + kept
        self._whitespace = text[len(kept) :]
