"""The decision model: predicts from draft-side features whether a drafted token will be
accepted, and the stop policy that uses it. Checkpoints describe themselves:

    <root>/<run-id>/config.json        kind, schema version, model pair, threshold, rule
                   /model.safetensors  weights + feature normalisation
                   /metrics.json       held-out metrics and replay results
    <root>/registry.json               every run, and `latest` (training.decider.registry)

Roots: checkpoints/deciders (DECIDERS_DIR: the shipped pair's, what `--decider latest`
reads) and runs/deciders (RUNS_DECIDERS: where training.fit and training.retrain write user runs).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from decoding.decider import features as F
from decoding.models.errors import ModelError
from decoding.models.fingerprint import fingerprint, same_model, stale_fingerprint
from decoding.models.weights import make_shareable
from decoding.options import RULES, THRESHOLD_RULES  # noqa: F401 (re-exported)
from decoding.stopping import CONFIDENCE_RULES, GROW, DraftLevel, StopPolicy, check_threshold

KINDS = ("mlp11", "hidden", "logistic", "mlp", "hybrid")
HIDDEN_KINDS = ("hidden", "hybrid")  # kinds that read the draft's hidden state


def uses_hidden(kind: str) -> bool:
    return kind in HIDDEN_KINDS


DECIDERS_DIR = Path(__file__).resolve().parents[2] / "checkpoints" / "deciders"
"""The shipped deciders root (tracked): written only by an explicit `--export.out` to it."""
RUNS_DECIDERS = "runs/deciders"
"""Default root of user fits and retrains (relative to the working directory, like runs/traces)."""
REGISTRY = "registry.json"


@dataclass
class DeciderConfig:
    kind: str = "mlp11"
    """mlp11: the paper's 11-feature MLP (11->44->1); hidden: draft hidden state MLP
    (H->512->256->1); logistic: all features -> 1; mlp: all features -> 64 -> 1; hybrid: all
    features AND the hidden state (F+H->256->64->1: a feature draft's h is computed from the
    target's own states)."""
    num_features: int = F.NUM_FEATURES
    hidden_size: int = 0
    """Draft hidden size (kinds hidden and hybrid)."""
    feature_schema: int = F.FEATURE_SCHEMA_VERSION
    threshold: float = 0.4
    """Stop threshold, chosen by replaying traces with the cost model."""
    rule: str = "paper"
    """paper: continue while any new node scores > threshold; specdecpp: stop once
    P(some drafted token on the best branch is rejected) > threshold; tree: extend each node
    whose predicted path acceptance (product of scores down to it) is >= threshold; grow: size
    the tree from the scores and the cost model (decoding.growth; no threshold)."""
    model_pair: dict = field(default_factory=dict)
    """{"target": fingerprint, "draft": fingerprint} the traces were recorded with."""
    cost_model: dict = field(default_factory=dict)
    label: str = "soft"
    thresholds: dict[str, float] = field(default_factory=dict)
    """Threshold chosen on the validation replay for EACH rule ({rule: threshold}); `threshold`
    is the one of `rule`. Empty in checkpoints fitted before it was recorded."""
    confidence_thresholds: dict[str, float] = field(default_factory=dict)
    """The draft-confidence baseline's threshold per confidence rule ({"level"|"tree": t}),
    tuned by the same validation replay, so baselines and decider are compared alike."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown decider kind {self.kind!r}; choose from {', '.join(KINDS)}")
        if self.rule not in RULES:
            raise ValueError(f"unknown stop rule {self.rule!r}; choose from {', '.join(RULES)}")
        check_threshold("decider threshold", self.threshold)
        for name, table, keys in (("thresholds", self.thresholds, RULES),
                                  ("confidence_thresholds", self.confidence_thresholds, CONFIDENCE_RULES)):
            if not isinstance(table, dict) or set(table) - set(keys):
                raise ValueError(f"{name} must map {' | '.join(keys)} to a threshold (got {table!r})")


class DeciderNet(nn.Module):
    def __init__(self, cfg: DeciderConfig):
        super().__init__()
        self.kind = cfg.kind
        self.num_features = cfg.num_features  # the first columns of node_features (its schema's)
        n_in = {"mlp11": 1 + F.TOP_K, "hidden": cfg.hidden_size,
                "hybrid": cfg.num_features + cfg.hidden_size}.get(cfg.kind, cfg.num_features)
        layers = {
            "mlp11": [nn.Linear(n_in, 44), nn.ReLU(), nn.Linear(44, 1)],
            "hidden": [nn.Linear(n_in, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1)],
            "logistic": [nn.Linear(n_in, 1)],
            "mlp": [nn.Linear(n_in, 64), nn.ReLU(), nn.Linear(64, 1)],
            "hybrid": [nn.Linear(n_in, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1)],
        }[cfg.kind]
        self.net = nn.Sequential(*layers)
        # input standardisation, fitted on training traces and saved with the weights
        self.register_buffer("mean", torch.zeros(n_in))
        self.register_buffer("std", torch.ones(n_in))

    def select(self, feats: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        if uses_hidden(self.kind):
            if hidden is None:
                raise ValueError(f"the {self.kind} decider needs draft hidden states")
            feats = feats[..., :self.num_features]
            return hidden.float() if self.kind == "hidden" else torch.cat([feats, hidden.float()], -1)
        return feats[..., F.PAPER_FEATURES] if self.kind == "mlp11" else feats[..., :self.num_features]

    def forward(self, feats: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [k] of 'this node will be accepted'."""
        x = (self.select(feats, hidden) - self.mean) / self.std
        return self.net(x).squeeze(-1)


class DeciderStop(StopPolicy):
    """Stop policy driven by a trained decider, with the paper's or SpecDec++'s rule."""

    name = "decider"

    def __init__(self, net: DeciderNet, cfg: DeciderConfig):
        self.net = net.eval()
        self.cfg = cfg
        self.needs_hidden = uses_hidden(cfg.kind)
        self._path: dict[int, float] = {}

    @torch.inference_mode()
    def scores(self, level: DraftLevel) -> torch.Tensor:
        """[k] acceptance probabilities, on the CPU (the rules below read them as floats).
        The net must sit on the features' device: Session moves it to the draft's at load."""
        return torch.sigmoid(self.net(F.node_features(level), F.node_hidden(level))).cpu()

    def _path_scores(self, level: DraftLevel, s: torch.Tensor) -> list[float]:
        """Predicted probability that the whole path down to each node is accepted."""
        if level.depth == 1:
            self._path = {}
        path = [self._path.get(p, 1.0) * float(x) for p, x in zip(level.parent_nodes, s)]
        self._path.update(zip(level.nodes, path))
        return path

    def should_stop(self, level: DraftLevel) -> bool:
        if self.cfg.rule == GROW:
            raise ValueError("the grow rule is a GrowPolicy over this decider's scores (Session.engine)")
        s = self.scores(level)
        valid = torch.tensor(level.valid, device=s.device)
        if not valid.any():
            return True
        if self.cfg.rule == "paper":
            return bool((s[valid] <= self.cfg.threshold).all())
        path = self._path_scores(level, s)
        best = max(v for v, ok in zip(path, level.valid) if ok)
        return 1.0 - best > self.cfg.threshold

    def expand(self, level: DraftLevel) -> list[bool]:
        if self.cfg.rule != "tree":
            return super().expand(level)
        path = self._path_scores(level, self.scores(level))
        return [ok and v >= self.cfg.threshold for v, ok in zip(path, level.valid)]


def _write_once_dir(out: Path, write) -> None:
    """Write a directory in full under a temp name, then rename it into place, refusing to
    replace one that exists: a checkpoint directory never changes once readers can see it
    (what `latest` names is switched by replacing registry.json, atomically)."""
    if out.exists():
        raise FileExistsError(f"{out} already exists: decider checkpoints are write-once, "
                              f"export under a new run id")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        write(tmp)
        make_shareable(tmp)
        try:
            os.rename(tmp, out)  # fails on a non-empty `out` made by a concurrent writer
        except OSError as e:
            if out.exists():
                raise FileExistsError(f"{out} was written concurrently: decider checkpoints are "
                                      f"write-once, export under a new run id") from None
            raise e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_decider(out: str | os.PathLike, net: DeciderNet, cfg: DeciderConfig, metrics: dict) -> Path:
    from safetensors.torch import save_file

    def write(tmp: Path):
        (tmp / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(tmp / "model.safetensors"))
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=1))

    out = Path(out)
    _write_once_dir(out, write)
    return out


def registry_root(path: str | os.PathLike | None) -> Path | None:
    """The deciders root `path` names ('latest' or None: the shipped one; a directory holding
    registry.json and no config.json; runs/deciders, the user root training.fit and
    training.retrain write, even before they have), else None (a run directory)."""
    if path in (None, "latest"):
        return DECIDERS_DIR
    p = Path(path)
    if p == Path(RUNS_DECIDERS) and not (p / "config.json").exists():
        return p
    return p if (p / REGISTRY).is_file() and not (p / "config.json").exists() else None


def resolve_decider_dir(path: str | os.PathLike | None) -> Path:
    """The decider directory `path` names: 'latest' (or None) = the shipped registry's latest; a
    deciders root = its latest, or while it has none the shipped latest (the champion a retrain
    judges its first challenger against: a server watching a user root serves it until then);
    anything else = that run directory."""
    root = registry_root(path)
    if root is None:
        return Path(path)
    reg = root / REGISTRY
    if root != DECIDERS_DIR and _no_latest(reg):
        return resolve_decider_dir("latest")
    try:
        latest = json.loads(reg.read_text())["latest"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ModelError(f"no usable decider registry at {reg}: pass --decider DIR") from None
    if not isinstance(latest, str) or not latest or "/" in latest or latest.startswith("."):
        raise ModelError(f"{reg} names no latest decider (latest = {json.dumps(latest)}): "
                         f"fit one (python -m training.fit) or pass --decider DIR")
    return root / latest


def _no_latest(reg: Path) -> bool:
    """A user root with nothing promoted yet (no registry, or one whose latest is null)."""
    try:
        return json.loads(reg.read_text()).get("latest") is None
    except FileNotFoundError:
        return True
    except (OSError, ValueError, AttributeError):
        return False  # unreadable or corrupt: resolving it says so


def _registered_for(root: Path, role: str, model_fp: dict) -> str:
    """A hint naming the newest decider registered in `root` fitted for this `role` model (its
    recorded fingerprint, not just the name: a promoted head keeps its name), for a root's
    `latest` refused because it belongs to another pair."""
    try:
        runs = json.loads((root / REGISTRY).read_text())["runs"]
        ids = [r["run_id"] for r in reversed(runs) if r.get("model_pair", {}).get(role) == model_fp.get("name")]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
    for run in ids:
        try:
            pair = json.loads((root / run / "config.json").read_text())["model_pair"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(pair.get(role), dict) and same_model(pair[role], model_fp):
            where = f"{root.parent.name}/{root.name}" if root == DECIDERS_DIR else str(root)
            return f"pass --decider {where}/{run} (fitted for this {role})"
    return ""


def load_decider(path, target=None, draft=None) -> tuple[DeciderNet, DeciderConfig]:
    """Load a decider; refuse one for another feature schema or model pair (one clear error)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = resolve_decider_dir(path)
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise ModelError(f"not a decider checkpoint (needs config.json and model.safetensors): {d}")
    try:
        cfg = DeciderConfig(**json.loads((d / "config.json").read_text()))
    except (ValueError, TypeError) as e:
        raise ModelError(f"corrupt decider config {d / 'config.json'}: {e}") from None
    # a schema only appends columns: an older one is read as the first columns of this one
    if cfg.feature_schema not in F.SCHEMA_COLUMNS or cfg.num_features != F.SCHEMA_COLUMNS[cfg.feature_schema]:
        raise ModelError(f"decider {d} uses feature schema {cfg.feature_schema} ({cfg.num_features} features), "
                         f"this code computes schema {F.FEATURE_SCHEMA_VERSION}: retrain it (python -m training.fit)")
    for role, model in (("target", target), ("draft", draft)):
        want = cfg.model_pair.get(role)
        if model is not None and want is not None and stale_fingerprint(want):
            raise ModelError(f"decider {d} records an older model fingerprint: update it with "
                             f"`python -m training.migrate_fingerprints {d}` (see --help)")
        if model is not None and want is not None and not same_model(want, fingerprint(model)):
            root = registry_root(path)
            hint = _registered_for(root, role, fingerprint(model)) if root else ""
            hint = hint or ("collect traces and fit one for this pair (python -m training.collect, then "
                            "python -m training.fit), or stop with fixed or confidence")
            raise ModelError(f"decider {d} was trained for another {role} model ({want.get('name')}): {hint}")
    net = DeciderNet(cfg)
    try:
        net.load_state_dict(load_file(str(d / "model.safetensors")))
    except (SafetensorError, RuntimeError, OSError) as e:
        raise ModelError(f"corrupt decider weights {d / 'model.safetensors'}: {str(e).splitlines()[0]}") from None
    return net.eval(), cfg
