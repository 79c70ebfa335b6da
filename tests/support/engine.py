"""Engine helpers shared by the lossless tests: the models on another forward, and a decider whose
stops vary from round to round."""

import copy

import torch

from decoding.decider.policy import DeciderConfig, DeciderNet, DeciderStop
from decoding.forward.packed import set_forward


def with_forward(models, kind):
    """Copies of the models running `kind` (decoding.forward.packed); eager: the models as given."""
    if kind == "eager":
        return models
    out = tuple(copy.deepcopy(m) for m in models)
    for m in out:
        assert set_forward(m, kind) == kind  # the fast path really runs (oneDNN present)
    return out


def random_decider(rule, threshold, seed=0, kind="logistic", hidden_size=0, cut=0.11):
    """A decider whose stops vary from round to round (any stop must stay lossless).

    logistic: score = sigmoid(40 * (q_token - cut)); hidden: sigmoid(100 * relu(h . v) - 1)
    for a random direction v, so scores swing with the draft's hidden state; hybrid: the same
    over the hidden part of its input (the features come first)."""
    from decoding.decider.features import FEATURE_NAMES, NUM_FEATURES

    torch.manual_seed(seed)
    cfg = DeciderConfig(kind=kind, rule=rule, threshold=threshold, hidden_size=hidden_size)
    net = DeciderNet(cfg)
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
        first, last = net.net[0], net.net[-1]
        if kind == "logistic":
            last.weight[0, FEATURE_NAMES.index("q_token")] = 40.0
            last.bias.fill_(-40.0 * cut)
        else:
            skip = NUM_FEATURES if kind == "hybrid" else 0
            first.weight[0, skip:] = torch.nn.functional.normalize(torch.randn(hidden_size), dim=0)
            net.net[2].weight[0, 0] = 1.0
            last.weight[0, 0] = 100.0
            last.bias.fill_(-1.0)
    return DeciderStop(net, cfg)
