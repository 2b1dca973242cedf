"""The tools' text files: UTF-8 lines read with the file and line named on error, and whole files written
atomically."""

import os
from collections.abc import Iterable


def read_lines(path: str) -> list[str]:
    """The lines of a UTF-8 text file, without their line ends; a decoding error names the file and the line."""
    with open(path, "rb") as f:
        return decode_lines((raw.removesuffix(b"\n") for raw in f), path)


def decode_lines(raw_lines: Iterable[bytes], name: str, first_line: int = 1) -> list[str]:
    """UTF-8 lines (ended at b"\n" only: U+2028 is not a line end) without a trailing \r; an undecodable line is a
    ValueError naming `name` and its line number (`first_line` is the number of the first)."""
    lines = []
    for number, raw in enumerate(raw_lines, first_line):
        try:
            lines.append(raw.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{name} is not UTF-8 text (line {number}: {error.reason}); convert it, e.g. with "
                             "`iconv -t utf-8`.") from error
    return lines


def write_atomically(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary sibling and a rename: the file is complete or absent."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
