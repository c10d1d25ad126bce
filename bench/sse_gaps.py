"""Shared by the streaming benchmarks: read one SSE completion response."""
import json
import time


def read_stream(resp, first=None):
    """Read an SSE completion response to its end. Returns (gaps between consecutive chunks
    that carry choices, in seconds; completion_tokens from the usage chunk, 0 without one).
    With a list as first, appends the perf_counter() time of the first chunk with choices."""
    last, gaps, got = None, [], 0
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data: ") or b"[DONE]" in line:
            continue
        now = time.perf_counter()
        ev = json.loads(line[6:])
        if ev.get("usage"):
            got = ev["usage"]["completion_tokens"]
        if not ev.get("choices"):
            continue
        if last is not None:
            gaps.append(now - last)
        elif first is not None:
            first.append(now)
        last = now
    return gaps, got
