"""Reading the files a user hands over (case files, run directories): regular files only, of a
bounded size, as JSON of a bounded depth. `/dev/zero`, a FIFO or a directory where a file should
be, a file that would fill the memory and JSON nested past any schema's depth are each a
ValueError with the reason, never a hang, a MemoryError or a traceback."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_DEPTH = 64  # deeper than any file mla-verify writes (a case file is 4 levels deep)


def regular_file(path: str | Path, limit: int) -> int:
    """The size of `path`; ValueError unless it is a regular file of at most `limit` bytes."""
    st = os.stat(path)  # a symlink is followed: what it names must be a regular file
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise ValueError(f"{path} is {kind}, not a regular file")
    if st.st_size > limit:
        raise ValueError(f"{path} is {st.st_size} bytes, over the {limit} a file of its kind may have")
    return st.st_size


def read_text(path: str | Path, limit: int) -> str:
    """The text of a regular file of at most `limit` bytes (it may not grow past it while read)."""
    regular_file(path, limit)
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} grew over {limit} bytes while read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _depth(obj: Any) -> int:
    """How deeply `obj` nests lists and objects (iteratively: a deep one cannot overflow the stack)."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (dict, list)):
            deepest = max(deepest, d)
            if d <= MAX_DEPTH:
                todo += [(v, d + 1) for v in (x.values() if isinstance(x, dict) else x)]
    return deepest


def read_json(path: str | Path, limit: int) -> Any:
    """A JSON file (`read_text`) nested at most MAX_DEPTH deep; ValueError with the reason otherwise."""
    text = read_text(path, limit)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"JSON nested too deeply (more than {MAX_DEPTH} levels)") from None
    if _depth(data) > MAX_DEPTH:
        raise ValueError(f"JSON nested too deeply (more than {MAX_DEPTH} levels)")
    return data
