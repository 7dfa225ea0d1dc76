"""
The optimizers, and which parameter each one trains: AdamW alone (--optimizer=adamw, the default), or Muon
for the hidden weight matrices beside AdamW for everything else (--optimizer=muon, modded-nanogpt's and
nanochat's split). configure_optimizers (GPT.configure_optimizers, nanoGPT's entry point, calls it) builds
the parameter groups from what the residual and MoD modes declare, next to their code in model.py, so a
new mode needs no edit here:
  no_decay_parameters()  its parameters that take no weight decay (norms and scalars never do); every
                 registered class with parameters defines its own (an inherited list is refused: it
                 would silently decay a matrix the subclass added), [] when the rule for norms and
                 scalars covers them
  decay_parameters()  its parameters of 2 or more dimensions that are projections and decay like a
                 Linear's weight; any other such parameter must be in one of the two lists
  mixing_parameters()  its mixing weights and gates: never trained by Muon, whatever their decay
                 (default: no_decay_parameters(); dwa_decay=True's alpha decays and is still one)
  lr_groups()    [(parameters, lr_scale), ...]: parameters trained at lr_scale times the run's LR,
                 without weight decay ([]: all at the run's LR)
  gate_parameters()  nag only: the gate group that --nag_gate_lr_scale and --nag_gate_decay act on

Muon is torch.optim.Muon (PyTorch >= 2.9): momentum, Newton-Schulz orthogonalisation of the (Nesterov)
momentum, a shape-dependent LR adjustment and decoupled weight decay. Two things train.py needs that it
does not do, added here:
- the non-finite-step skip. Fused AdamW skips a step on the device when handed found_inf; torch's Muon
  has no such flag, so SkippingMuon keeps a copy of its parameters and momentum buffers and, after the
  step, puts them back where found_inf > 0 (torch.where on the device: no host sync);
- one optimizer object for two: MuonAdamW is one torch Optimizer over both's parameter groups (the same
  dicts), so the LR schedule, zero_grad, GradScaler.unscale_, step hooks and checkpoints see one optimizer.
"""

import atexit
import os
import shutil
import sys
import tempfile

import torch
import torch.nn as nn

from configurator import ConfigError


def configure_optimizers(model, weight_decay, learning_rate, betas, gate_lr_scale=1.0, gate_decay=False, muon=None):
    """The optimizer of a GPT. Weight decay on matrices and embeddings (>= 2-D); none on norms, gains and
    scalars, nor on what a mode lists in no_decay_parameters(). Groups of their own, without decay, whose
    "lr_scale" train.py multiplies the scheduled LR by: the mode's lr_groups() (scalars' multipliers), and
    with gate_lr_scale != 1 the gates of a mode with gate_parameters() (nag); gate_decay=True decays the
    gates' matrices (an ablation). muon (a dict: lr, momentum, weight_decay, adjust_lr_fn), or None for
    AdamW alone: Muon trains the hidden matrices (hidden_matrices), AdamW the rest as above."""
    check_compile_cache()
    stream = model.stream
    if (gate_lr_scale != 1.0 or gate_decay) and not hasattr(stream, "gate_parameters"):
        raise ValueError(f"gate_lr_scale={gate_lr_scale}, gate_decay={gate_decay} only apply to residual=nag")
    if gate_lr_scale != 1.0 and gate_decay:
        raise ValueError("gate_decay=True needs gate_lr_scale=1: the gate group has no decay")
    own = [(stream.gate_parameters(), gate_lr_scale)] if gate_lr_scale != 1.0 else []
    own += stream.lr_groups()
    apart = {id(p) for params, _ in own for p in params}
    parts = [part for part in (stream, model.mod) if part is not None]
    for part in parts:
        check_decay_declared(part)
    exempt = {id(p) for part in parts for p in part.no_decay_parameters()}
    if gate_decay:
        exempt -= {id(p) for p in stream.gate_parameters()}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in apart]
    decay = [p for p in params if p.dim() >= 2 and id(p) not in exempt]
    no_decay = [p for p in params if p.dim() < 2 or id(p) in exempt]
    matrices = hidden_matrices(model, decay) if muon is not None else []
    to_muon = {id(p) for p in matrices}
    decay = [p for p in decay if id(p) not in to_muon]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    for params, scale in own:
        groups.append({"params": list(params), "weight_decay": 0.0, "lr": learning_rate * scale, "lr_scale": scale})
    if muon is None:
        # fused on every device (CPU too): the fastest AdamW, and the one that can skip a step on the
        # device when handed found_inf (train.py's non-finite-step skip)
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)
    muon = dict(muon)
    lr = muon.pop("lr")  # the schedule scales it as AdamW's: lr_scale is its ratio to learning_rate
    matrix_group = {"params": matrices, "lr": lr, "lr_scale": lr / learning_rate}
    return MuonAdamW([matrix_group], groups, muon, dict(lr=learning_rate, betas=betas))


def check_compile_cache():
    """torch's optimizers import torch._dynamo when they are built, and that import makes torch.compile's cache
    folder, $TORCHINDUCTOR_CACHE_DIR (unset: a folder in the temp folder, which tempfile finds writable). One that
    cannot be made or written (one under a read-only HOME, say) would be a traceback at the start of every run,
    compiled or not: a fresh temporary folder stands in for it in this process, removed at exit, and a line says
    so; with no temporary folder to be had either, a one-line error names the fix."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not path or "torch._dynamo" in sys.modules:  # imported: the folder was made
        return
    try:
        os.makedirs(path, exist_ok=True)
        if os.access(path, os.W_OK | os.X_OK):
            return
        problem = "is not writable"
    except OSError as e:
        problem = f"cannot be made ({e.strerror})"
    try:
        stand_in = tempfile.mkdtemp(prefix="torchinductor_")
    except OSError:
        raise ConfigError(f"TORCHINDUCTOR_CACHE_DIR {path} {problem}: set TORCHINDUCTOR_CACHE_DIR to a writable "
                          f"folder (torch's optimizers make it, even without --compile)") from None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = stand_in
    atexit.register(shutil.rmtree, stand_in, ignore_errors=True)
    print(f"note: TORCHINDUCTOR_CACHE_DIR {path} {problem}: torch.compile's cache is {stand_in} for this run "
          f"(set TORCHINDUCTOR_CACHE_DIR to a writable folder to keep it)", file=sys.stderr, flush=True)


def hidden_matrices(model, decayed):
    """--optimizer=muon: the parameters Muon trains, of the decayed ones: the 2-D weights of hidden
    layers (attention's and the MLP's, and a mode's projections: decay_parameters() and its Linear
    weights). Not the token embedding nor the LM head (modded-nanogpt's and nanochat's split), not a
    mode's mixing_parameters() whatever their decay, and not a matrix with a single row or column (a
    router's score is a vector: orthogonalising it would only normalise it)."""
    parts = [part for part in (model.stream, model.mod) if part is not None]
    outside = {id(model.wte.weight), id(model.lm_head.weight)}
    outside |= {id(p) for part in parts for p in part.mixing_parameters()}
    return [p for p in decayed if p.dim() == 2 and min(p.shape) > 1 and id(p) not in outside]


def check_decay_declared(part):
    """A mode (residual or MoD) says which of its parameters take weight decay: a class with parameters
    defines its own no_decay_parameters(), and every parameter of 2 or more dimensions is a Linear or
    Embedding weight (decayed) or in no_decay_parameters() or decay_parameters(). An inherited list, or
    a matrix in neither, would be a silent guess: a one-line error names the fix."""
    cls = type(part).__name__
    if any(True for _ in part.parameters()) and "no_decay_parameters" not in vars(type(part)):
        raise ValueError(f"{cls} states no no_decay_parameters(): give it its own (optim.py's docstring says how; "
                         f"return [] when its norms and scalars are all it has)")
    declared = {id(p) for p in (*part.no_decay_parameters(), *part.decay_parameters())}
    declared |= {id(m.weight) for m in part.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    for name, p in part.named_parameters():
        if p.dim() >= 2 and id(p) not in declared:
            raise ValueError(f"{cls}.{name} {list(p.shape)} is neither a Linear weight nor in no_decay_parameters() "
                             f"or decay_parameters(): list it in the one that says whether it takes weight decay")


class SkippingMuon(torch.optim.Muon):
    """torch.optim.Muon that leaves its parameters and momentum exactly as they were when `found_inf`
    (a 0-d device tensor, set as an attribute before step() as for fused AdamW) is > 0. The copies cost
    one parameter-sized and one buffer-sized tensor per matrix for the length of a step."""

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return super().step(closure)
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:  # Muon's first step makes the buffer as zeros: made here, it is kept the same way
            self.state[p].setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))
        before = [(p.clone(), self.state[p]["momentum_buffer"].clone()) for p in params]
        loss = super().step(closure)
        skip = found_inf > 0
        for p, (p0, buf0) in zip(params, before):
            buf = self.state[p]["momentum_buffer"]
            p.copy_(torch.where(skip, p0, p))
            buf.copy_(torch.where(skip, buf0, buf))
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """Muon's groups, then AdamW's (fused: it skips on found_inf itself), as one optimizer. param_groups
    are the two optimizers' own dicts, so what train.py writes into a group (the scheduled LR) is what the
    optimizer that owns it reads. found_inf, set before step(), goes to both."""

    def __init__(self, muon_groups, adamw_groups, muon_kwargs, adamw_kwargs):
        self.muon = SkippingMuon(muon_groups, **muon_kwargs)
        self.adamw = torch.optim.AdamW(adamw_groups, fused=True, **adamw_kwargs)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        for opt in (self.muon, self.adamw):
            opt.found_inf = found_inf
            opt.step()
            del opt.found_inf
        return None

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict):
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError("this optimizer state is not Muon + AdamW's (the run trained with optimizer=adamw)")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # a torch optimizer's load_state_dict makes new group dicts: point at them, or the schedule's LR
        # would go into the old ones, which nothing reads any more
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
