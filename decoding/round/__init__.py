"""A whole speculative round as one static-shape function of device tensors: the head's draft
levels, the target's verify, the acceptance and the commit of both caches, with lengths kept on
the device. On CUDA each (shape, cache columns) round is captured once as a CUDA graph and a
round costs one replay and one host read (the new tokens); on a CPU the same code runs eagerly
(`--round device`), which is how the CPU proves it."""
