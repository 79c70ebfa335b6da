"""Command-line helpers every trainer shares: dataclass configs from a YAML file plus overrides
(one flag per field), the Lightning CLI with a `run:` section, one-line usage errors."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

from decoding.options import FLAGS, add_option


def _flag_type(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _flag_type(args[0]) if args else str
    if tp is bool:
        return lambda s: s.lower() in ("1", "true", "yes", "on")
    return tp if tp in (int, float, str) else None


def field_docs(cls) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string right after each field; base classes' too)."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, IndexError):
            continue
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr) \
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def _help(f: dataclasses.Field, docs: dict[str, str]) -> str:
    """A field's one help text: the shared flag's where the registry has one (decoding.options), else
    the field's docstring; with the config's default."""
    text = FLAGS[f.name].help if f.name in FLAGS else docs.get(f.name, "")
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    if default not in (None, "", [], {}, ()):
        text += f" (default: {default})"
    return text.replace("%", "%%")


def parse_config(cls, argv=None, prog: str = "", description: str = "", aliases=None):
    """`--config FILE.yaml` then `--field value` overrides; errors end with one clear line.
    `aliases` maps a field to extra flag spellings. Every flag's help is the shared registry's or
    its field's docstring."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    ap = argparse.ArgumentParser(prog=prog, description=description)
    add_option(ap, "config")
    for f in dataclasses.fields(cls):
        tp = _flag_type(hints[f.name])
        flags = ["--" + f.name.replace("_", "-"), *(aliases or {}).get(f.name, [])]
        if tp is None:  # lists: space-separated values
            ap.add_argument(*flags, dest=f.name, nargs="+", help=_help(f, docs))
        else:
            ap.add_argument(*flags, dest=f.name, type=tp, help=_help(f, docs))
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


def usage_error(msg: str) -> None:
    """A config the trainer cannot run: one line, exit 2."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def lightning_cli(module_cls, data_cls, run_cls, argv: list[str] | None):
    """LightningCLI with a `run:` section (`run_cls`), torch threads set before anything is
    built. Returns run, trainer, module, datamodule, checkpoint callback and its last.ckpt."""
    import torch
    from lightning.pytorch.cli import LightningCLI

    class CLI(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_class_arguments(run_cls, "run")

    threads = peek_threads(argv if argv is not None else sys.argv[1:])
    if threads:
        torch.set_num_threads(threads)
    cli = CLI(module_cls, data_cls, run=False, args=argv, save_config_kwargs={"overwrite": True})
    cli.trainer.callbacks.append(_validate_at_max_steps())
    run = cli.config["run"]
    run = run_cls(**(run if isinstance(run, dict) else vars(run)))
    cb = cli.trainer.checkpoint_callback
    if cb is None or not cb.dirpath:
        usage_error("the config needs a ModelCheckpoint callback with a dirpath")
    return run, cli.trainer, cli.model, cli.datamodule, cb, Path(cb.dirpath) / "last.ckpt"


def _validate_at_max_steps():
    """A run ending at trainer.max_steps between two validations ends with one, as a run ending
    at max_time does (Lightning validates when asked to stop): its last steps are validated,
    checkpointed and exported, not those of the validation before."""
    from lightning.pytorch.callbacks import Callback

    class ValidateAtMaxSteps(Callback):
        def on_train_batch_end(self, trainer, *_) -> None:
            if 0 < trainer.max_steps <= trainer.global_step:
                trainer.should_stop = True

    return ValidateAtMaxSteps()


def peek_threads(argv: list[str]) -> int | None:
    """Thread count must be set before torch does any work; read it from argv/the config."""
    import yaml

    for i, a in enumerate(argv):
        if a.startswith("--run.threads"):
            v = a.split("=", 1)[1] if "=" in a else argv[i + 1]
            return None if v in ("null", "None") else int(v)
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv) and Path(argv[i + 1]).is_file():
            conf = yaml.safe_load(Path(argv[i + 1]).read_text()) or {}
            return (conf.get("run") or {}).get("threads")
    return None


def ckpt_metrics(ckpt: str) -> dict:
    import torch

    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    out = {}
    for cb in state.get("callbacks", {}).values():
        if isinstance(cb, dict) and "best_model_score" in cb and cb["best_model_score"] is not None:
            out[str(cb.get("monitor"))] = float(cb["best_model_score"])
    return out | {"global_step": int(state.get("global_step", 0)), "epoch": int(state.get("epoch", 0))}


def relative_path(path) -> str:
    """A path inside the working directory as a relative one (metadata travels with the repo)."""
    p = Path(path).resolve()
    return str(p.relative_to(Path.cwd())) if p.is_relative_to(Path.cwd()) else str(path)
