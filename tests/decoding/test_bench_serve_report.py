"""The serve suite's report from its runs (no server started): medians and ranges over repeats,
the ratio over one by one, and the plot (llama.cpp's -np N rows one line across N)."""

from decoding.bench.plots import serve_plot
from decoding.bench.serve_suite import serve_markdown, summary


def _run(row, clients, repeat, tok_s):
    return {"row": row, "clients": clients, "repeat": repeat, "tok_s": tok_s, "errors": [],
            "ttft_ms": {"p50": 50.0, "p90": 90.0}, "tpot_ms": {"p50": 4.0, "p90": 5.0}}


RES = {"prompts": 16, "new_tokens": 96, "threads": 2, "repeats": 3, "runs": [
    *[_run("ours, joint", n, r, 100.0 * n + r) for n in (1, 4) for r in range(3)],
    *[_run("ours, one by one", n, r, 100.0 + 10 * r) for n in (1, 4) for r in range(3)],
    *[_run(f"llama.cpp -np {n}", n, r, 50.0) for n in (1, 4) for r in range(3)]]}


def test_summary_medians_ranges_and_ratio():
    s = summary(RES)
    assert s["ours, joint @ 4"] == {"tok_s": 401.0, "range": [400.0, 402.0], "x_one_by_one": round(401 / 110, 3)}
    assert s["llama.cpp -np 4 @ 4"]["x_one_by_one"] == round(50 / 110, 3)
    assert "| ours, joint @ 4 | 401.0 [400.0, 402.0] |" in serve_markdown(RES)


def test_the_plot_is_a_png_with_a_line_a_server(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = []
    errorbar = matplotlib.axes.Axes.errorbar
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar",
                        lambda self, x, y, **k: drawn.append((k["label"], list(x))) or errorbar(self, x, y, **k))
    assert serve_plot(summary(RES), tmp_path / "serve.png") == "serve.png"
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(drawn) == [("llama.cpp -np N", [1, 4]), ("ours, joint", [1, 4]), ("ours, one by one", [1, 4])]
    assert not list(tmp_path.glob(".*.tmp"))
