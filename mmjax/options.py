"""Options defined once: a dataclass field carries its type, default and help, and the CLI flag
is generated from it (vLLM's `EngineArgs.add_cli_args` pattern).

    @dataclass
    class Args(Options):
        max_num_seqs: int = option(8, help="decode slots")
        overlap: bool = option(True, flag="--no-overlap", action="store_false", help="...")

    Args.add_cli_args(parser)            # --max-num-seqs, --no-overlap
    args = Args.from_cli_args(parser.parse_args())
    Args(max_num_seqs=4)                 # the same option as a Python keyword

A field's flag is `--field-name` unless `flag=` names another; the argparse dest is the field
name, so several `Options` classes can share one parser. `env=` makes the flag's default the
value of that environment variable when set (read when the parser is built); `convert=` maps the
parsed value to the field's value (e.g. a template path to its text); `cli=False` keeps a field
off the command line (a Python-only keyword).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Callable

_ARGPARSE_KEYS = ("type", "choices", "action", "nargs")


def option(default: Any = dataclasses.MISSING, *, help: str | None = None, flag: str | None = None,
           aliases: tuple[str, ...] = (), env: str | None = None, convert: Callable | None = None,
           cli: bool = True, default_factory: Any = dataclasses.MISSING, meta: dict | None = None,
           **argparse_kw) -> Any:
    """A dataclass field that is also a CLI flag; argparse_kw: type, choices, action, nargs;
    meta: more field metadata for the class's own use."""
    unknown = set(argparse_kw) - set(_ARGPARSE_KEYS)
    if unknown:
        raise TypeError(f"option(): unknown argparse keywords {sorted(unknown)}")
    meta = {"help": help, "flag": flag, "aliases": tuple(aliases), "env": env, "convert": convert, "cli": cli,
            "argparse": argparse_kw, **(meta or {})}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


class Options:
    """Mixin for a dataclass whose `option()` fields are CLI flags."""

    @classmethod
    def cli_fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", False)]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup):
        """One flag per CLI field, dest = the field name; returns `parser`."""
        for f in cls.cli_fields():
            m = f.metadata
            kw = dict(m["argparse"])
            default = _default(f)
            if m["env"] and os.environ.get(m["env"]) is not None:
                raw = os.environ[m["env"]]
                default = type(default)(raw) if isinstance(default, (int, float)) else raw
            if isinstance(default, bool) and "action" not in kw:
                kw["action"] = "store_false" if default else "store_true"
            if isinstance(default, tuple):
                default = list(default)
            parser.add_argument(m["flag"] or "--" + f.name.replace("_", "-"), *m["aliases"], dest=f.name,
                                default=default, help=m["help"], **kw)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        """The instance a parsed namespace describes (its other classes' dests are ignored)."""
        values = {}
        for f in cls.cli_fields():
            v = getattr(args, f.name)
            if f.metadata["convert"] is not None:
                v = f.metadata["convert"](v)
            elif isinstance(v, list):
                v = tuple(v)
            values[f.name] = v
        return cls(**values)


# ---- argparse value types ------------------------------------------------------------------

def positive_int(v: str) -> int:
    n = int(v)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return n


def non_negative_int(v: str) -> int:
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {v}")
    return n


def positive_float(v: str) -> float:
    x = float(v)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {v}")
    return x


def key_value(v: str) -> tuple[str, str]:
    """'name=path' -> ('name', 'path'); with nargs="+" and convert=dict a flag becomes a dict."""
    name, sep, value = v.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {v!r}")
    return name, value


def mib_to_bytes(v: str) -> int:
    """A MiB count on the command line -> bytes (a negative count means 0)."""
    return max(int(v), 0) * 2**20


def memory_budget(text: str) -> int | float:
    """'0.9' -> 0.9 (a fraction of device memory); '20GiB' / '512MiB' / '2e10' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    unit = next((u for u in sorted(units, key=len, reverse=True) if t.endswith(u)), None)
    try:
        value = float(t[:-len(unit)] if unit else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count or a fraction: {text!r}") from None
    if unit:
        value *= units[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value if value <= 1 and not unit else int(value)
