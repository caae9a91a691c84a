"""A work step that looks for corral's tokens where a hostile work could: the initial
environment, the command line and the readable memory of every process it can see (or of
the pids given as arguments). Run as ``python3 -c SOURCE [PID...]``; standard library only.

It prints one line per process, ``scanned pid=N cmd=... environ=ok|denied mem=BYTES|denied``,
and one per token found, ``found pid=N in=environ|cmdline|mem token=PREFIX...`` (masked).
The pattern is built so that this source holds no token prefix itself, and the scanner
skips its own process.
"""

import os
import re
import sys
from collections.abc import Iterator

# corral's session, registration, enrolment and warm channel tokens.
PATTERN = re.compile(rb"cr" + rb"[stew]" + rb"_[A-Za-z0-9_-]{8,}")
LIMIT = 256 << 20  # bytes of memory read per process, at most


def anonymous_regions(pid: int) -> Iterator[tuple[int, int]]:
    """Readable mappings that are not files: the heap, the stack, and anonymous ones, where
    a process keeps what it received."""
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            name = fields[5] if len(fields) > 5 else ""
            if fields[1].startswith("r") and name in ("", "[heap]", "[stack]"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                yield start, end


def memory(pid: int) -> tuple[set[bytes], int | str]:
    """(tokens, bytes read), or (set(), "denied")."""
    found: set[bytes] = set()
    read = 0
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            for start, end in anonymous_regions(pid):
                size = min(end - start, LIMIT - read)
                if size <= 0:
                    break
                try:
                    mem.seek(start)
                    data = mem.read(size)
                except OSError:
                    continue
                read += len(data)
                found.update(PATTERN.findall(data))
    except OSError:
        return found, "denied"
    return found, read


def read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None


def scan(pid: int) -> None:
    cmdline = read(f"/proc/{pid}/cmdline") or b""
    environ = read(f"/proc/{pid}/environ")
    found_mem, mem_read = memory(pid)
    command = cmdline.replace(b"\0", b" ").decode(errors="replace")[:60]
    print(
        f"scanned pid={pid} cmd={command!r} "
        f"environ={'denied' if environ is None else 'ok'} mem={mem_read}"
    )
    places = (("cmdline", PATTERN.findall(cmdline)), ("environ", PATTERN.findall(environ or b"")))
    for where, tokens in (*places, ("mem", found_mem)):
        for token in sorted(set(tokens)):
            print(f"found pid={pid} in={where} token={token[:10].decode()}...")


def main() -> None:
    me = os.getpid()
    pids = [int(a) for a in sys.argv[1:]] or sorted(
        int(e) for e in os.listdir("/proc") if e.isdigit()
    )
    for pid in pids:
        if pid != me:
            scan(pid)
    print("scan done")


main()
