"""decoding.defaults: the measured-best default configuration, how it is picked and rewritten."""

import json
from pathlib import Path

import pytest

from decoding import defaults as D
from decoding.bench.pick_defaults import pick_best, write_defaults
from decoding.forward import cpu

ROOT = Path(__file__).resolve().parents[2]


def spec(name, strategy="ti-mcsd", **kw):
    return {"name": name, "strategy": strategy, "mode": "lossless", "stop": "fixed", **kw}


def row(name, median, ci=None, lossless=True, equal=(3, 3), status="ok", setting=None):
    sp = {"median": median, **({"ci95": ci} if ci else {})}
    return {"name": name, "status": status, "lossless": lossless, "speedup": sp,
            "equal_to_ar": {"equal": equal[0], "n": equal[1]}, "stop_setting": setting}


def results(rows_by_cond, specs, dtype="float32"):
    conds = [{"name": f"greedy/{i}", "temperature": 0.0, "rows": rows} for i, rows in enumerate(rows_by_cond)]
    conds.append({"name": "T=0.7/0", "temperature": 0.7, "rows": [row("slow", 9.0)]})  # not greedy: ignored
    return {"meta": {"dtype": dtype, "date": "2026-01-01", "threads": 2, "command": "bench",
                     "config": {"strategies": [spec("ar", "ar"), *specs]}}, "conditions": conds}


def test_pick_best_takes_the_fastest_lossless_row_that_beats_ar_everywhere():
    specs = [spec("W2 D2", width=2, depth=2), spec("sd", "sd", gamma=3),
             spec("lossy", mode="longest-branch"), spec("wide ci", width=8, depth=8),
             spec("mismatch", "mcsd", k_config="2,1"), spec("peer", "hf-assisted"),
             spec("conf", stop="confidence", confidence_threshold="tuned", confidence_rule="tree")]
    conds = [[row("W2 D2", 1.5, [1.2, 1.8]), row("sd", 1.4, [1.1, 1.6]), row("lossy", 3.0, [2, 4], lossless=False),
              row("wide ci", 2.5, [0.9, 3.0]), row("mismatch", 2.9, [2, 3], equal=(2, 3)), row("peer", 5.0, [4, 6]),
              row("conf", 1.55, [1.3, 1.7], setting={"rule": "tree", "threshold": 0.2})],
             [row("W2 D2", 1.5, [1.2, 1.8]), row("sd", 1.7, [1.5, 1.9]), row("lossy", 3.0, [2, 4], lossless=False),
              row("wide ci", 2.5, [1.5, 3.0]), row("mismatch", 2.9, [2, 3]), row("peer", 5.0, [4, 6]),
              row("conf", 1.45, [1.3, 1.6], setting={"rule": "tree", "threshold": 0.2})]]
    best = pick_best(results(conds, specs), source="r.json")
    # geometric means: W2 D2 1.5, sd 1.543, conf 1.498; wide ci / mismatch / lossy / peer excluded
    assert {k: best[k] for k in ("strategy", "gamma", "stop", "dtype")} == \
        {"strategy": "sd", "gamma": 3, "stop": "fixed", "dtype": "float32"}
    assert best["measured"] == {"greedy/0": 1.4, "greedy/1": 1.7} and best["source"].startswith("r.json")
    # bf16: near-tie flips are expected, so equality with ar is not asked
    assert pick_best(results(conds, specs, dtype="bfloat16"))["strategy"] == "mcsd"
    # the tuned confidence row reproduces with the threshold it ran with
    only_conf = [[r for r in c if r["name"] == "conf"] for c in conds]
    assert pick_best(results(only_conf, specs))["confidence_threshold"] == 0.2
    # reports that tell near-tie flips from mismatches: a tie is fine in any dtype, a mismatch never
    tie = [[dict(r, equal_to_ar={"equal": 2, "tie": 1, "mismatch": 0, "n": 3}) for r in c] for c in only_conf]
    assert pick_best(results(tie, specs))["strategy"] == "ti-mcsd"
    tie[1][0]["equal_to_ar"]["mismatch"] = 1
    assert pick_best(results(tie, specs, dtype="bfloat16"))["strategy"] == "ar"


def test_a_grown_tree_row_becomes_a_default_with_its_cost_curve_source():
    grow = spec("grow(q)", width=4, depth=8, max_nodes=48, stop="confidence", confidence_rule="grow",
                grow_cost="measure")
    conds = [[row("grow(q)", 1.5, [1.2, 1.8], setting={"rule": "grow", "scores": "q"})]] * 2
    entry = pick_best(results(conds, [grow]))
    assert {k: entry[k] for k in ("confidence_rule", "max_nodes", "grow_cost", "width", "depth")} == \
        {"confidence_rule": "grow", "max_nodes": 48, "grow_cost": "measure", "width": 4, "depth": 8}
    assert "confidence_threshold" not in entry  # the grow rule has none
    d = D.Defaults(**{k: v for k, v in entry.items() if k != "measured"})
    cfg = D.strategy_config(d, None, {})
    assert (cfg.confidence_rule, cfg.max_nodes, cfg.grow_cost) == ("grow", 48, "measure")
    assert "grow" in d.describe() and "48 nodes" in d.describe()
    dec = spec("grow(decider)", width=4, depth=8, stop="decider", rule="grow", grow_cost="decider")
    picked = pick_best(results([[row("grow(decider)", 1.5, [1.2, 1.8], setting={"rule": "grow"})]] * 2, [dec]))
    assert (picked["decider_rule"], picked["grow_cost"], picked["max_nodes"]) == ("grow", "decider", 64)


def test_pick_best_falls_back_to_ar_and_needs_a_greedy_condition():
    slow = [[row("W2 D2", 0.9)], [row("W2 D2", 1.3)]]
    assert pick_best(results(slow, [spec("W2 D2", width=2, depth=2)]))["strategy"] == "ar"
    with pytest.raises(ValueError, match="no greedy condition"):
        pick_best({"meta": {}, "conditions": []})


def test_write_defaults_replaces_one_entry_atomically(tmp_path, monkeypatch):
    f = tmp_path / "defaults.yaml"
    write_defaults({"strategy": "sd", "gamma": 2, "source": "a"}, "cpu", f)
    write_defaults({"strategy": "ar", "dtype": "bfloat16", "source": "b"}, "cuda", f)
    data = D.load_defaults(f)
    assert data["cpu"]["gamma"] == 2 and data["cuda"]["strategy"] == "ar"
    assert "# cuda: b" in f.read_text()  # which report each entry came from

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(D.os, "replace", crash)
    with pytest.raises(OSError):
        write_defaults({"strategy": "mcsd"}, "cpu", f)
    assert D.load_defaults(f) == data and list(tmp_path.iterdir()) == [f]  # old file, no temp left
    with pytest.raises(ValueError, match="not default options: colour"):
        write_defaults({"colour": "red"}, "cpu", f)


def test_device_kind_follows_amx():
    assert cpu.prefers_bf16("flags\t: fpu avx2 amx_bf16 amx_tile\n", packed=False)
    # AVX512-BF16 without AMX: float32 measured faster on the eager forward (reports/dtype-2026-11-26),
    # bfloat16 on the packed one (reports/forward-2026-11-26)
    assert not cpu.prefers_bf16("flags\t: fpu avx2 avx512f avx512_bf16\n", packed=False)
    assert cpu.prefers_bf16("flags\t: fpu avx2 avx512f avx512_bf16\n", packed=True)
    assert not cpu.prefers_bf16("flags\t: fpu sse avx avx2 fma\n", packed=True)
    assert D.device_kind("cuda:0") == "cuda" and D.device_kind("cpu") in ("cpu", "cpu-bf16")


def test_an_avx2_only_cpu_acted_on_a_bigger_one(monkeypatch):
    """$SPECSTOP_CPU=avx2: the flags lose AVX512 / AMX / AVX-VNNI, so our AVX512 kernels stand
    down, float32 is the fast dtype and the quantized kernel's `auto` is its AVX2 path; the cost
    curve's key names the act; anything else is one clear error."""
    from decoding.forward import kernels, quant

    info = "model name\t: Big Xeon\nflags\t: fpu avx avx2 fma f16c avx512f avx512_bf16 amx_bf16 avx_vnni\n"
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: info)
    monkeypatch.setattr(cpu, "warn_torch_isa", lambda: None)  # torch loaded as it is, here
    monkeypatch.setenv(cpu.CPU_ENV, "avx2")
    assert cpu.flags() == {"fpu", "avx", "avx2", "fma", "f16c"} and not cpu.prefers_bf16(packed=True)
    assert cpu.model_name() == "Big Xeon (as AVX2 only)" and "avx512f" in cpu.flags(info)
    monkeypatch.setattr(kernels, "_state", {})
    assert "the CPU lacks avx512f" in kernels.why_not()
    monkeypatch.delenv(quant.ISA_ENV, raising=False)
    assert quant._isa_arg() == quant.ISAS["avx2"]
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv(cpu.CPU_ENV, "")
    assert cpu.prefers_bf16() and quant._isa_arg() == quant.ISAS["auto"] and cpu.model_name() == "Big Xeon"
    monkeypatch.setenv(cpu.CPU_ENV, "sse")
    with pytest.raises(ValueError, match="SPECSTOP_CPU must be avx2 or empty"):
        cpu.flags()


def test_a_run_writes_the_entry_of_its_dtype():
    """An fp32 run on an AMX CPU measured the `cpu` entry: written into `cpu-bf16` (the entry the
    machine loads) it turned that entry's dtype to float32."""
    assert D.run_kind("cpu", "float32") == "cpu" and D.run_kind("cpu", "bfloat16") == "cpu-bf16"
    assert D.run_kind("cuda:0", "bfloat16") == "cuda" and D.run_kind("cuda", "float32") == "cuda"


def test_committed_defaults_are_valid_and_reproduce_their_report():
    data = D.load_defaults()
    assert set(D.KINDS) | {D.OTHER} <= set(data)
    assert data["cpu"]["dtype"] == "float32"  # no AMX: float32 measured faster
    for kind, entry in data.items():
        d = D.Defaults(**entry)
        D.strategy_config(d, None, {})  # every option valid for the engine
        report = ROOT / d.source.split(" ")[0]
        if d.source.startswith("reports/") and report.is_file():  # a measured entry
            picked = pick_best(json.loads(report.read_text()))
            assert {k: v for k, v in picked.items() if k != "source"} == \
                {k: v for k, v in entry.items() if k != "source"}, kind


def test_bench_write_defaults(tmp_path, capsys):
    from decoding.bench.cli import main

    f = tmp_path / "defaults.yaml"
    out = tmp_path / "report"
    assert main(["--quick", "--no-sweep", "--temperatures", "0", "--repeats", "1", "--out", str(out),
                 "--write-defaults", str(f)]) == 0
    res = json.loads((out / "results.json").read_text())
    kind = D.run_kind("cpu", res["meta"]["dtype"])
    entry = D.load_defaults(f)[kind]
    assert entry == pick_best(res, source=str(out / "results.json"))
    # with no PATH the pick goes into the report's own copy of the defaults
    package = D.DEFAULTS_PATH.read_text()
    out2 = tmp_path / "r2"
    assert main(["--quick", "--no-sweep", "--temperatures", "0", "--repeats", "1", "--out", str(out2),
                 "--write-defaults"]) == 0
    mine = D.load_defaults(out2 / "defaults.yaml")
    # the pick of its own run: two timed runs may rank near-equal rows differently
    res2 = json.loads((out2 / "results.json").read_text())
    assert mine[kind] == pick_best(res2, source=str(out2 / "results.json"))
    assert set(mine) == set(D.load_defaults())
    # the package's own file: never from a bench run (refused before the run)
    capsys.readouterr()
    assert main(["--quick", "--no-sweep", "--out", str(tmp_path / "r3"), "--write-defaults", str(D.DEFAULTS_PATH)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make defaults" in err and not (tmp_path / "r3").exists()
    assert D.DEFAULTS_PATH.read_text() == package


def test_the_package_defaults_come_from_a_kept_report(tmp_path, monkeypatch, capsys):
    """`make defaults REPORT=DIR`: the entry of the report's kind, as the committed file has it;
    a report of another pair is refused in one line, the file untouched."""
    from decoding.bench import pick_defaults as P

    monkeypatch.chdir(ROOT)  # sources cite reports/ relative to the repository
    data = D.load_defaults()
    report = data["cpu"]["source"].split(" ")[0]
    if not (ROOT / report).is_file():
        pytest.skip(f"{report} is not in this checkout")
    kind, entry = P.package_entry(Path(report).parent)
    assert kind == "cpu" and entry == data["cpu"]
    f = tmp_path / "defaults.yaml"
    f.write_text(D.DEFAULTS_PATH.read_text())
    monkeypatch.setattr(D, "DEFAULTS_PATH", f)  # main writes the package's file: here, a copy
    monkeypatch.setattr(P, "DEFAULTS_PATH", f)
    assert P.main([report]) == 0 and D.load_defaults(f) == data
    other = json.loads((ROOT / report).read_text())
    other["meta"]["config"]["draft"] = str(tmp_path / "another-draft")
    (tmp_path / "other.json").write_text(json.dumps(other))
    capsys.readouterr()
    assert P.main([str(tmp_path / "other.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "shipped pair" in err and D.load_defaults(f) == data
    assert P.main([]) == 2 and P.main(["--help"]) == 0


def test_a_named_strategy_or_shape_runs_as_named():
    """`--strategy sd --gamma 3` runs as named: it once inherited the defaults' grow rule."""
    d = D.Defaults(strategy="ti-mcsd", width=4, depth=8, stop="confidence", confidence_rule="grow",
                   max_nodes=48, grow_cost="measure")
    unset = dict.fromkeys(("gamma", "k_config", "width", "depth", "stop", "confidence_rule"))
    assert D.strategy_config(d, None, unset).name == "ti-mcsd[W=4,D=8]+confidence(grow)"  # nothing named
    sd = D.strategy_config(d, "sd", {**unset, "gamma": 3})
    assert (sd.name, sd.stop, sd.k_levels) == ("sd[g=3]", "fixed", (1, 1, 1))
    same = D.strategy_config(d, "ti-mcsd", unset)  # the default's strategy, named: its own values
    assert (same.width, same.depth, same.stop, same.max_nodes) == (4, 6, "fixed", 64)
    shaped = D.strategy_config(d, None, {**unset, "width": 2, "depth": 3})  # a shape alone
    assert (shaped.strategy, shaped.k_levels, shaped.stop) == ("ti-mcsd", (2, 1, 1), "fixed")
    asked = D.strategy_config(d, "sd", {**unset, "stop": "confidence"})  # a stop rule given is kept
    assert (asked.stop, asked.confidence_rule) == ("confidence", "level")
