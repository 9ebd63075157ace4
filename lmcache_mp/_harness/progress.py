"""The one-line progress display of ``lmcache-mp bench`` and ``eval``."""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

__all__ = ["ProgressLine"]

#: Seconds between two redraws of the progress line.
_REDRAW_INTERVAL = 0.25


class ProgressLine:
    """A one-line ``[executor] phase 1.2 s elapsed`` display on a terminal.

    Redrawn in place (carriage return) by a daemon thread while the block
    runs, then erased. Silent unless the stream is a TTY, so pipes, files
    and CI logs stay clean.

    Args:
        label: What runs, e.g. ``"[process] modify"``.
        stream: Where to draw (default: ``sys.stderr`` now).
        enabled: ``None`` (default): draw when the stream is a TTY;
            ``False``: never draw; ``True``: always draw.
    """

    def __init__(
        self, label: str, stream: TextIO | None = None, enabled: bool | None = None
    ) -> None:
        self._label = label
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = _is_tty(self._stream) if enabled is None else enabled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0
        self._width = 0

    @property
    def enabled(self) -> bool:
        """Whether the line is drawn (the stream is a TTY)."""
        return self._enabled

    def __enter__(self) -> ProgressLine:
        self._start = time.perf_counter()
        if self._enabled:
            self._draw()
            self._thread = threading.Thread(
                target=self._loop, name="lmcache-mp-bench-progress", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._enabled:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()

    def _draw(self) -> None:
        text = f"{self._label} {time.perf_counter() - self._start:.1f} s elapsed"
        self._width = max(self._width, len(text))
        self._stream.write("\r" + text.ljust(self._width))
        self._stream.flush()

    def _loop(self) -> None:
        while not self._stop.wait(_REDRAW_INTERVAL):
            self._draw()


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        # Closed or fake streams.
        return False
