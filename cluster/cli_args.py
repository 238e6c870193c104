"""Command-line flags generated from config dataclasses: one `--flag` per field.

Fields declare their help text where they are defined, with `opt(default, "help")`;
`add_dataclass_args` turns each into a flag (`max_inflight` -> `--max-inflight`):
bool fields get `--x/--no-x`, Literal fields get choices, others parse as the default's
type. `from_args` builds the (validated) dataclass back from the parsed namespace.
"""
from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, field, fields


def opt(default, help: str):
    """A dataclass field with its CLI help text."""
    return field(default=default, metadata={"help": help})


def add_dataclass_args(parser: argparse.ArgumentParser, cls, prefix: str = "") -> None:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        flag = "--" + prefix.replace("_", "-") + f.name.replace("_", "-")
        dest = prefix + f.name
        # (argparse %-formats help: a default the parser's set_defaults changes shows as changed)
        kw: dict = {"dest": dest, "help": f.metadata.get("help", "").replace("%", "%%")}
        default = f.default if f.default is not MISSING else None
        hint = hints[f.name]
        if hint is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **kw)
            continue
        choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        if choices:
            kw["choices"] = choices
        kind = type(choices[0]) if choices else type(default)
        kw["help"] += " (default: %(default)r)"
        parser.add_argument(flag, type=kind, default=default, **kw)


def from_args(args: argparse.Namespace, cls, prefix: str = ""):
    return cls(**{f.name: getattr(args, prefix + f.name) for f in fields(cls)})
