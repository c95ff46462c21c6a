"""argparse types shared by the `gradhub` commands (cli.py, plan/cli.py):
a bad value becomes argparse's one-line error naming the flag and what it
accepts (`gradhub simulate: error: argument --hosts: 0 is out of range (at
least 1)`, exit code 2), never a traceback further on."""

from __future__ import annotations

import argparse
import math
import os

_MOST = 2**31


def count(least: float, kind=int, *, above: bool = False, most: float = _MOST):
    """An argparse type: a finite number of `kind` (int or float), at least
    `least` (more than it with `above`) and at most `most`."""
    accepts = f"{'more than' if above else 'at least'} {least}" + (f", at most {most}" if most != _MOST else "")

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} ({accepts})") from None
        if not math.isfinite(v) or v < least or (above and v == least) or v > most:
            raise argparse.ArgumentTypeError(f"{text} is out of range ({accepts})")
        return v
    return parse


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    return count(0, most=65535)(text)


def existing_file(text: str) -> str:
    """An argparse type: a file that exists and can be read."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text}: {'a folder, not a file' if os.path.isdir(text) else 'no such file'}")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot read it (permission denied)")
    return text


def output_file(text: str) -> str:
    """An argparse type: a file to write, in a folder that exists."""
    folder = os.path.dirname(text) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: a folder, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: no folder {folder}")
    return text


class Parser(argparse.ArgumentParser):
    """argparse's parser, its usage errors one line on stderr (exit code 2):
    `gradhub plan: error: argument --hosts: 0 is out of range (at least 1)
    (see gradhub plan --help)`; subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
