"""The launcher's output: every child's bytes, forwarded as they come with
the child's label in front.

Whole lines are written whole, so lines of different processes never mix.
A carriage return (a tqdm progress bar redrawing itself) is forwarded at
once, as `\\r[label] text`, so the bar moves in place under its label; a
line that follows an unfinished progress update (a core log line written
between two redraws) gets its own line instead of being spliced into it.
"""

from __future__ import annotations

import enum
import os
import re
import threading
from typing import BinaryIO, Callable

# A line in which a process names itself as the job numbers it: the core's
# log prefix (`[gradhub worker 2] ...`, `[gradhub server 1/t0] ...`).
_SELF_NAME = re.compile(rb"^\[gradhub (worker|server) (\d+)(?:/t\d+)?\]")


def own_name(label: str, text: bytes) -> str | None:
    """The label `text` calls for: the number the process gives itself
    (its rank in the job, which an elastic job's service assigns and may
    change each generation), on a label of the same role; None: keep it."""
    m = _SELF_NAME.match(text)
    if m is None:
        return None
    role, num = m.group(1).decode(), m.group(2).decode()
    name, at, host = label.partition("@")
    if name.split(" ")[0] != role or name == f"{role} {num}":
        return None
    return f"{role} {num}{at}{host}"


class Terminal:
    """The launcher's stdout, shared by every child's pump: at most one
    child at a time has an unfinished (progress) line on it."""

    def __init__(self, out: BinaryIO):
        self.out = out
        self.lock = threading.Lock()
        self.open: object | None = None  # the pump whose progress line is unfinished

    def progress(self, who: object, prefix: bytes, text: bytes) -> None:
        """Redraw `who`'s progress line as `text`."""
        with self.lock:
            if self.open is not None and self.open is not who:
                self.out.write(b"\n")  # another child's bar stays; this one starts below
            self.out.write(b"\r" + prefix + text)
            self.open = who
            self.out.flush()

    def line(self, who: object, prefix: bytes, text: bytes, redraw: bool) -> None:
        """Write `text` as a line of its own; `redraw`: it is the final
        state of `who`'s progress line (its text followed a carriage return)."""
        with self.lock:
            if self.open is not None and not (redraw and self.open is who):
                self.out.write(b"\n")
            self.out.write((b"\r" if redraw else b"") + prefix + text + b"\n")
            self.open = None
            self.out.flush()

    def end(self, who: object) -> None:
        """`who` ended without finishing its progress line."""
        with self.lock:
            if self.open is who:
                self.out.write(b"\n")
                self.out.flush()
                self.open = None


class Segment(enum.Enum):
    """What the bytes after the last line break or carriage return are."""
    LINE = "line"          # after a newline (or at the start): an ordinary line
    PROGRESS = "progress"  # after a carriage return: a redraw of a progress line


class Pump:
    """Reads one child's output and writes it to the terminal under `label`."""

    def __init__(self, terminal: Terminal, label: str, fd: int, renamed: Callable[[str], None] | None = None):
        """`renamed(label)`: the process named itself otherwise (`own_name`);
        its lines from then on carry the new label."""
        self.terminal = terminal
        self.label = label
        self.renamed = renamed
        self.prefix = f"[{label}] ".encode()
        self.fd = fd
        self.kind = Segment.LINE
        self.pending = b""   # the current segment's bytes so far
        self.shown = 0       # how many of them were drawn as progress already

    def run(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                data = b""
            if not data:
                break
            self.feed(data)
        if self.pending:
            self._finish(self.pending, b"\n")
        self.terminal.end(self)

    def feed(self, data: bytes) -> None:
        buf = self.pending + data
        start = 0
        while True:
            cuts = [i for i in (buf.find(b"\n", start), buf.find(b"\r", start)) if i >= 0]
            if not cuts:
                break
            i = min(cuts)
            end = buf[i:i + 1]
            if end == b"\r" and buf[i + 1:i + 2] == b"\n":  # a CRLF line end
                i, end = i + 1, b"\n"
                self._finish(buf[start:i - 1], end)
            else:
                self._finish(buf[start:i], end)
            start = i + 1
        self.pending = buf[start:]
        if self.kind is Segment.PROGRESS and len(self.pending) > self.shown:
            # Draw the unfinished redraw now: its end is the next redraw.
            self.terminal.progress(self, self.prefix, self.pending)
            self.shown = len(self.pending)

    def _finish(self, text: bytes, end: bytes) -> None:
        """The segment `text` ended with `end`."""
        if self.kind is Segment.PROGRESS:
            if self.shown and len(text) > self.shown:
                # Bytes written after the drawn redraw, with no carriage
                # return of their own: another writer (a log line), on its own line.
                self.terminal.end(self)
                self._write(text[self.shown:], end, redraw=False)
            elif len(text) > self.shown:
                self._write(text, end, redraw=True)
            elif end == b"\n":  # the redraw is on the terminal whole already: end its line
                self.terminal.end(self)
        elif text or end == b"\n":
            self._write(text, end, redraw=False)
        self.kind = Segment.PROGRESS if end == b"\r" else Segment.LINE
        self.shown = 0

    def _write(self, text: bytes, end: bytes, redraw: bool) -> None:
        label = own_name(self.label, text)
        if label is not None:
            self.label, self.prefix = label, f"[{label}] ".encode()
            if self.renamed is not None:
                self.renamed(label)
        if end == b"\r":
            self.terminal.progress(self, self.prefix, text)
        else:
            self.terminal.line(self, self.prefix, text, redraw)
