"""CLI contract of `python -m decoding.generate`, on tiny model directories made here."""

import json

import pytest

from support.models import WORDS, noisy_copy, save_tiny, tiny_llama
from decoding.generate import main, parser


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny_llama(0, vocab=len(WORDS), scale=6, max_pos=64)
    t = save_tiny(root / "target", WORDS, target)
    d = save_tiny(root / "draft", WORDS, noisy_copy(target, 0.03))
    shuffled = WORDS[:2] + WORDS[2:][::-1]  # same size, different ids
    bad = save_tiny(root / "badtok", shuffled, noisy_copy(target, 0.03))
    return t, d, bad


def run(capsys, *args):
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_output_and_lossless_equality(dirs, capsys):
    t, d, _ = dirs
    base = ["--prompt", "w1 w2 w3", "--target", t, "--draft", d, "--max-new-tokens", "20", "--json"]
    rc, out, _ = run(capsys, *base, "--strategy", "ar")
    ar = json.loads(out)
    assert rc == 0 and set(ar) == {"text", "token_ids", "stats"}
    for extra in (["--strategy", "sd"], ["--strategy", "mcsd", "--k-config", "3,2,1"],
                  ["--strategy", "ti-mcsd", "--stop", "confidence"]):
        rc, out, _ = run(capsys, *base, *extra)
        res = json.loads(out)
        assert rc == 0 and res["token_ids"] == ar["token_ids"] and res["stats"]["lossless"]
        for key in ("target_calls", "drafted", "accepted", "acceptance_rate", "block_efficiency",
                    "tokens_per_s", "wall_s", "draft_s", "verify_s", "bookkeeping_s"):
            assert key in res["stats"]


def test_streaming_prints_text_and_stats(dirs, capsys):
    t, d, _ = dirs
    rc, out, err = run(capsys, "--prompt", "w4", "--target", t, "--draft", d, "--max-new-tokens", "8")
    assert rc == 0 and out.strip().startswith("w") and "tok/s" in err and "ti-mcsd" in err


def test_longest_branch_says_lossy(dirs, capsys):
    t, d, _ = dirs
    rc, out, _ = run(capsys, "--prompt", "w1", "--target", t, "--draft", d, "--strategy", "ti-mcsd",
                     "--mode", "longest-branch", "--max-new-tokens", "10", "--json")
    stats = json.loads(out)["stats"]
    assert rc == 0 and stats["lossless"] is False and "LOSSY" in stats["strategy"]
    assert "LOSSY" in parser().format_help()


@pytest.mark.parametrize("args,message", [
    (["--prompt", ""], "empty prompt"),
    (["--prompt", "   "], "empty prompt"),
    (["--prompt", "w1", "--strategy", "mcsd", "--k-config", "4,x"], "bad k-config"),
    (["--prompt", "w1", "--max-new-tokens", "500"], "prompt too long"),
    (["--prompt", "w1", "--target", "/no/such/dir"], "model directory not found"),
    (["--prompt", "w1", "--stop", "decider"], "decider"),
    (["--prompt", "w1", "--temperature", "-1"], "temperature"),
])
def test_bad_input_one_error_line(dirs, capsys, args, message):
    t, d, _ = dirs
    full = ["--target", t, "--draft", d] + args if "--target" not in args else ["--draft", d] + args
    rc, out, err = run(capsys, *full)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error:") and message in err


def test_mismatched_tokenizer_refused(dirs, capsys):
    t, _, bad = dirs
    rc, _, err = run(capsys, "--prompt", "w1", "--target", t, "--draft", bad, "--strategy", "sd",
                     "--max-new-tokens", "4")
    assert rc == 2 and "different token ids" in err and err.count("\n") == 1


def test_speculation_without_draft_refused(dirs, capsys):
    t, _, _ = dirs
    rc, _, err = run(capsys, "--prompt", "w1", "--target", t, "--strategy", "mcsd")
    assert rc == 2 and "--draft" in err


def test_unknown_strategy_exits_nonzero(dirs, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--prompt", "w1", "--strategy", "beam"])
    assert e.value.code == 2


def test_option_values_are_checked_before_torch_is_imported():
    """A typo in an option is refused in a fraction of a second: generate checks every value
    before importing torch / transformers (the fault table's option rows rely on it)."""
    import subprocess
    import sys

    code = ("import sys; from decoding.generate import main; rc = main(['--prompt', 'x', '--width', '0']); "
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["2", "False", "False"], p.stdout + p.stderr
    assert p.stderr.startswith("error: fork tree needs width >= 1") and p.stderr.count("\n") == 1


def _decider_for(tmp_path, target_dir, draft_dir, name="dec", **cfg_kw):
    from decoding.decider.policy import DeciderConfig, DeciderNet, save_decider
    from decoding.models import fingerprint, load_model

    pair = {"target": fingerprint(load_model(target_dir)), "draft": fingerprint(load_model(draft_dir))}
    cfg = DeciderConfig(kind="logistic", model_pair=pair, **cfg_kw)
    return str(save_decider(tmp_path / name, DeciderNet(cfg), cfg, {}))


def test_decider_checkpoints_are_checked(dirs, capsys, tmp_path):
    t, d, bad = dirs
    base = ["--prompt", "w1 w2", "--target", t, "--draft", d, "--strategy", "ti-mcsd", "--stop", "decider",
            "--max-new-tokens", "6", "--json"]
    ok = _decider_for(tmp_path, t, d, threshold=-1.0)
    rc, out, _ = run(capsys, *base, "--decider", ok)
    assert rc == 0 and json.loads(out)["stats"]["lossless"]
    other_draft = save_tiny(tmp_path / "draft2", WORDS, noisy_copy(tiny_llama(0, vocab=len(WORDS), scale=6,
                                                                            max_pos=64), 0.03, seed=7))
    other = _decider_for(tmp_path, t, other_draft, name="other")  # recorded with another draft
    rc, out, err = run(capsys, *base, "--decider", other)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "another draft model" in err
    schema = _decider_for(tmp_path, t, d, name="schema", feature_schema=99)
    rc, _, err = run(capsys, *base, "--decider", schema)
    assert rc == 2 and "feature schema 99" in err
    weights = tmp_path / "dec" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])  # truncated checkpoint
    rc, _, err = run(capsys, *base, "--decider", ok)
    assert rc == 2 and err.count("\n") == 1 and "corrupt decider weights" in err
    rc, _, err = run(capsys, *base, "--decider", str(tmp_path / "missing"))
    assert rc == 2 and "not a decider checkpoint" in err


def test_grow_rules_from_the_cli(dirs, capsys, tmp_path):
    """--decider-rule grow / --confidence-rule grow size the tree from the checkpoint's cost
    model; the output is ar's; a checkpoint without a cost model is one clear error."""
    t, d, _ = dirs
    base = ["--prompt", "w1 w2", "--target", t, "--draft", d, "--strategy", "ti-mcsd", "--max-new-tokens", "12",
            "--json", "--width", "3", "--depth", "4", "--max-nodes", "16"]
    cost = {"sizes": [1, 16], "target_ms": [10.0, 11.0], "draft_ms": [1.0, 1.5]}
    dec = _decider_for(tmp_path, t, d, cost_model=cost)
    rc, out, _ = run(capsys, "--prompt", "w1 w2", "--target", t, "--strategy", "ar", "--max-new-tokens", "12", "--json")
    want = json.loads(out)["text"]
    for rule in (["--stop", "decider", "--decider-rule", "grow"], ["--stop", "confidence", "--confidence-rule", "grow"]):
        rc, out, err = run(capsys, *base, *rule, "--decider", dec)
        assert rc == 0, err
        res = json.loads(out)
        assert res["text"] == want and res["stats"]["lossless"] and res["stats"]["drafted"] > 0
    bare = _decider_for(tmp_path, t, d, name="bare")
    rc, out, err = run(capsys, *base, "--stop", "confidence", "--confidence-rule", "grow", "--decider", bare)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "no usable cost model" in err


def test_a_named_strategy_is_not_changed_by_the_defaults(dirs, capsys, tmp_path, monkeypatch):
    """`--strategy sd --gamma 3` runs sd with gamma 3: it once ran the defaults' stop rule."""
    import yaml

    from decoding import defaults as dflt

    t, d, _ = dirs
    f = tmp_path / "defaults.yaml"
    f.write_text(yaml.safe_dump({"other-pairs": {"strategy": "ti-mcsd", "width": 2, "depth": 5, "stop": "confidence",
                                                 "confidence_threshold": 0.99, "dtype": "float32"}}))
    monkeypatch.setattr(dflt, "DEFAULTS_PATH", f)
    base = ["--prompt", "w1 w2 w3", "--target", t, "--draft", d, "--max-new-tokens", "30", "--json"]
    rc, out, _ = run(capsys, *base)
    assert rc == 0 and json.loads(out)["stats"]["strategy"] == "ti-mcsd[W=2,D=5]+confidence"  # nothing named
    rc, out, _ = run(capsys, *base, "--strategy", "sd", "--gamma", "3")
    stats = json.loads(out)["stats"]
    assert rc == 0 and stats["strategy"] == "sd[g=3]"
    assert stats["drafted_depths"] == {"3": stats["rounds"]}  # 3 tokens drafted every round
    assert "name neither --strategy nor a shape" in parser().format_help()
