"""Server-sent events: the framing of OpenAI-style streaming responses.

Only what a completions stream uses: ``data:`` fields, blank-line event
boundaries, ``:`` comments. ``event:``, ``id:`` and ``retry:`` fields are
read and dropped (OpenAI-compatible servers send data-only events).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["DONE", "encode_event", "iter_events"]

#: The data of the event that ends an OpenAI-style stream.
DONE = "[DONE]"


def iter_events(lines: Iterable[bytes]) -> Iterator[str]:
    """Yield the data of each event as soon as its closing blank line arrives.

    Args:
        lines: Raw lines as read from the response, with their line endings
            (``\\n``, ``\\r\\n`` or ``\\r``); read lazily, one at a time.

    Returns:
        An iterator of event data strings (multi-line data joined by
        ``\\n``). An event left unterminated when the lines end is yielded
        too: a server that closes right after ``data: [DONE]`` has ended
        the stream properly.

    Raises:
        UnicodeDecodeError: If a line is not UTF-8.
    """
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            # The spec strips exactly one space after the colon.
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def encode_event(data: str) -> bytes:
    """Frame one event's data (a single line, e.g. compact JSON).

    Args:
        data: The event data; must not contain a newline.

    Returns:
        ``b"data: <data>\\n\\n"``.

    Raises:
        ValueError: If ``data`` contains a line break.
    """
    if "\n" in data or "\r" in data:
        raise ValueError(f"SSE event data must be one line, got {data[:80]!r}")
    return f"data: {data}\n\n".encode()
