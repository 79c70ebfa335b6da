"""Helpers shared by the tests (not tests): tiny models, synthetic traces, fixtures' builders,
fault cases and seams. Importable as `support.*` from every test folder (pytest's pythonpath)."""
