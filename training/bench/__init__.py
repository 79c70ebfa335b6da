"""Benches of what training makes, before it ships (they read training code, so they live here,
not in decoding.bench, which inference installs without training):

- head: the feature head's teacher-forced agreement with the target on held-out prompts, steps
  1..4, with intervals (`python -m training.bench.head`; redistill's gate scores with its
  `agreement`);
- compare: two heads' eval files from `head`, paired differences and a plot
  (`python -m training.bench.compare NEW.json BASE.json`);
- positions: a head's step-1 acceptance by context position on a corpus's validation rows
  (`python -m training.bench.positions`);
- draft_cost: drafts' step cost over a target step at several thread counts, and what it buys
  back in decoding (`python -m training.bench.draft_cost`).

Decoding speed on engines and strategies is measured by decoding.bench.
"""
