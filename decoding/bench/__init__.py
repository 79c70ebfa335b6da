"""The benchmark and its suites: `python -m decoding.bench` (cli: compare / engine / dtype),
the configs it reads (config), measuring rows (runs), statistics (stats), the report and
plots (report, plots), the quick CI pair (quick), greedy agreement with ar (agreement), the
bf16 tie study (`python -m decoding.bench.ties`) and the oracle-stop bound (oracle)."""
