"""Dataclass configs from a YAML file plus command-line overrides (one flag per field)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path


def _flag_type(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _flag_type(args[0]) if args else str
    if tp is bool:
        return lambda s: s.lower() in ("1", "true", "yes", "on")
    return tp if tp in (int, float, str) else None


def parse_config(cls, argv=None, prog: str = "", description: str = "", aliases=None):
    """`--config FILE.yaml` then `--field value` overrides; errors end with one clear line.
    `aliases` maps a field to extra flag spellings."""
    hints = typing.get_type_hints(cls)
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--config", help=f"YAML file with {cls.__name__} fields")
    for f in dataclasses.fields(cls):
        tp = _flag_type(hints[f.name])
        flags = ["--" + f.name.replace("_", "-"), *(aliases or {}).get(f.name, [])]
        if tp is None:  # lists: space-separated values
            ap.add_argument(*flags, dest=f.name, nargs="+")
        else:
            ap.add_argument(*flags, dest=f.name, type=tp)
    args = vars(ap.parse_args(argv))
    values: dict = {}
    path = args.pop("config")
    if path:
        import yaml

        p = Path(path)
        if not p.is_file():
            raise SystemExit(f"error: config file not found: {p}")
        try:
            values = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise SystemExit(f"error: {p}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(values, dict):
            raise SystemExit(f"error: {p}: expected a mapping of {cls.__name__} fields")
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise SystemExit(f"error: {p}: unknown keys {sorted(unknown)}")
    values.update({k: v for k, v in args.items() if v is not None})
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
