"""The EAGLE-3-style feature head: the model (feature), its tree proposer (proposer), the
target's hidden-state capture it reads (capture), its checkpoint (io) and the stand-alone
draft's on-disk format (format)."""
