"""`make demo` (training.demo) end to end on a tiny pair: collect -> fit -> the table."""

import json

from decoding.bench.quick import tiny_pair
from training import demo


def test_demo_on_a_tiny_pair(tmp_path, capsys):
    t, d, _ = tiny_pair(tmp_path / "models")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i % 30} w{(i * 7) % 30} w{i % 11}"}) + "\n"
                               for i in range(24)))
    out = tmp_path / "demo"
    rc = demo.main(["--out", str(out), "--target", t, "--draft", d, "--prompts", str(prompts),
                    "--max-prompts", "16", "--collect-new-tokens", "12", "--prompt", "w3 w4 w5",
                    "--max-new-tokens", "16", "--cost-model", "default",
                    "--threads", "1"])
    text = capsys.readouterr().out
    assert rc == 0 and (out / "deciders" / "demo" / "config.json").is_file()
    table = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    labels = [line.split(" | ")[0][2:] for line in table]
    assert labels[0] == "ar (plain decoding)" and labels[1].startswith("default: ti-mcsd W4 D6")  # other-pairs
    assert labels[2:] == ["W4 D6 fixed depth", "W4 D6 confidence", "W4 D6 confidence (tree)", "W4 D6 decider"]
    for line in table:
        cells = line.strip("| ").split(" | ")
        speedup, lossless = cells[2], cells[-1]
        assert speedup.endswith("x") and float(speedup[:-1]) > 0 and lossless == "True"
    assert table[0].split(" | ")[2] == "1.00x"
