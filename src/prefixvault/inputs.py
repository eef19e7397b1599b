"""Files and values a user hands the command line, read within bounds.

A command line is an interface anyone can aim anything at: ``/dev/zero`` as a prompt file, a
named pipe nobody writes to, a JSON file nested a hundred thousand deep, a token id past 2^64,
ten million token ids, a 5,000-character path. Each is refused here with one line naming the
argument, never a traceback and never a hang: a file is read only if it is a regular file (a
pipe, a device, a socket or a directory is refused before a byte is read, since reading one can
wait forever), and never past its bound.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

#: Longest path or model name accepted (Linux's PATH_MAX).
MAX_PATH = 4096
#: Largest file read as a prompt, token ids or requests.
MAX_INPUT_BYTES = 64 << 20
#: Deepest JSON nesting accepted (prompts are lists of lists at most).
MAX_JSON_DEPTH = 32
#: Token ids are int32 in vLLM.
MAX_TOKEN_ID = 2**31 - 1
#: Most token ids accepted as one prompt: the longest context of current models (1M tokens).
MAX_TOKEN_IDS = 1 << 20


class InputError(ValueError):
    """A bad argument; the message is one line naming it."""


def check_path(path: str, what: str) -> str:
    if len(path) > MAX_PATH:
        raise InputError(f"{what} is longer than {MAX_PATH} characters")
    if "\x00" in path:
        raise InputError(f"{what} contains a NUL character")
    return path


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def read_bounded(path: str, what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """A regular file's bytes, at most ``limit`` of them. Opened without blocking (opening a
    named pipe nobody writes to would wait forever) and refused unless it is a regular file."""
    check_path(path, what)
    shown = repr(path[:200])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise InputError(f"cannot read {what} {shown}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputError(f"{what} {shown} is {_kind(mode)}: give a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise InputError(f"cannot read {what} {shown}: {e.strerror or e}") from None
    if len(data) > limit:
        size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"
        raise InputError(f"{what} {shown} is larger than {size}")
    return data


def _depth(text: str) -> int:
    """Deepest bracket nesting outside strings (a linear scan: no recursion on hostile input)."""
    depth = worst = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            worst = max(worst, depth)
        elif ch in "]}":
            depth -= 1
    return worst


def load_json(path: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON file read within bounds: size, nesting depth and UTF-8 checked first."""
    data = read_bounded(path, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{what} {path[:200]!r} is not UTF-8 text") from None
    if _depth(text) > max_depth:
        raise InputError(f"{what} {path[:200]!r} is nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except ValueError as e:
        raise InputError(f"{what} {path[:200]!r} is not JSON: {str(e)[:200]}") from None


def token_ids(data: Any, what: str) -> list[int]:
    """A JSON list of token ids, each in vLLM's range, at most ``MAX_TOKEN_IDS`` of them."""
    if not isinstance(data, list) or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in data):
        raise InputError(f"{what} must hold a JSON list of token ids in 0..{MAX_TOKEN_ID}")
    return bounded_prompt(data, what)


def bounded_prompt(tokens: list[int], what: str) -> list[int]:
    """``tokens``, unless there are more than ``MAX_TOKEN_IDS`` of them."""
    if len(tokens) > MAX_TOKEN_IDS:
        raise InputError(f"{what} holds {len(tokens)} token ids: at most {MAX_TOKEN_IDS} are accepted")
    return tokens
