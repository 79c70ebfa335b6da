"""Every shared command-line option is declared once, in decoding.options.FLAGS, and commands take
it through add_option / add_options: no command declares such a flag itself (with its own help or
choices), read from the source with `ast`."""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from decoding.options import FLAGS, add_option, add_options, flag_of

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("decoding", "training")
SHARED_MODULE = ROOT / "decoding" / "options.py"


def own_declarations(root: Path = ROOT) -> list[str]:
    """'file:line --flag' for each add_argument call outside the shared module naming a shared flag."""
    shared = {flag_of(name) for name in FLAGS}
    found = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            if path == SHARED_MODULE:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr == "add_argument":
                    for arg in node.args:
                        if isinstance(arg, ast.Constant) and arg.value in shared:
                            found.append(f"{path.relative_to(root)}:{node.lineno} {arg.value}")
    return found


def test_no_command_declares_a_shared_option_itself():
    found = own_declarations()
    assert not found, ("declare these through decoding.options.add_option (one help, one set of "
                       "choices):\n" + "\n".join(found))


def test_the_guard_sees_a_declaration(tmp_path):
    (tmp_path / "decoding").mkdir()
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "cmd.py").write_text(
        'import argparse\nap = argparse.ArgumentParser()\nap.add_argument(\n    "--target", help="mine")\n')
    assert own_declarations(tmp_path) == ["training/cmd.py:3 --target"]


def test_one_help_and_one_spelling_per_flag():
    spellings = [flag_of(name) for name in FLAGS]
    assert len(spellings) == len(set(spellings))
    for name, f in FLAGS.items():
        assert f.help.strip(), name
        assert "%" not in f.help, f"{name}: argparse formats help with %"


def test_commands_share_the_help_and_differ_only_in_default():
    a, b = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_options(a, "target", "threads", "dtype")
    add_option(b, "threads", default=2)
    add_option(b, "target", required=True)
    add_option(b, "dtype", only=("float32", "bfloat16"))
    helps = {p: {x.dest: x for x in p._actions} for p in (a, b)}
    assert helps[a]["threads"].help.startswith(FLAGS["threads"].help)
    assert helps[b]["threads"].help.startswith(FLAGS["threads"].help)
    assert b.parse_args(["--target", "t"]).threads == 2
    with pytest.raises(SystemExit):
        b.parse_args(["--target", "t", "--dtype", "float16"])
    with pytest.raises(ValueError, match="subset"):
        add_option(argparse.ArgumentParser(), "dtype", only=("int8",))


def test_several_values_replace_the_default():
    ap = argparse.ArgumentParser()
    add_option(ap, "clients", several=True, default=[1, 2])
    assert ap.parse_args([]).clients == [1, 2]
    assert ap.parse_args(["--clients", "1,2,4", "--clients", "8"]).clients == [1, 2, 4, 8]
    assert ap.parse_args(["--clients", "3", "5"]).clients == [3, 5]
    with pytest.raises(SystemExit):
        ap.parse_args(["--clients", "x"])


def test_config_commands_explain_every_option():
    """The trainers' flags generated from their config dataclasses: each has one help text (the
    shared flag's, else its field's docstring), and the description is a whole paragraph."""
    import contextlib
    import io
    import re

    import pytest

    from training.decider import ceiling, collect, retrain
    from training.head import redistill

    for mod in (collect, retrain, redistill, ceiling):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            mod.main(["--help"])
        text = out.getvalue()
        options = text.split("options:", 1)[1]
        entries = re.split(r"\n  (?=-)", options)[1:]
        helps = [" ".join(e.split()[2:]) for e in entries]  # after the flag and its metavar
        bare = [e.split()[0] for e, h in zip(entries, helps) if not re.sub(r"\(default: [^)]*\)", "", h).strip()]
        assert not bare, f"{mod.__name__}: options without help: {bare}"
        description = text.split("options:", 1)[0].strip().split("\n\n")[-1]
        assert description.rstrip().endswith((".", ")", ":", "?")), f"{mod.__name__}: {description[-80:]!r}"
