"""The drafts at inference. The EAGLE-3-style feature head: the model (feature) and its shapes
(feature_config), its tree proposer (feature_proposer), the target's hidden-state capture it
reads (capture), its steps on a static cache (head_graph) and on the kernels (lean_step), its
checkpoint (io). The stand-alone draft: its output layer pruned to the target's frequent tokens
(pruned) and its on-disk format (format). A draft of either kind for a loaded target: attach.
The shapes a draft tree may take, in plain Python for the option checks (tree_shapes)."""
