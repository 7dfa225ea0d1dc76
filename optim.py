"""
The optimizers: AdamW alone (--optimizer=adamw, the default), or Muon for the hidden weight matrices beside
AdamW for everything else (--optimizer=muon, modded-nanogpt's and nanochat's split). GPT.configure_optimizers
decides which parameter goes where, from the modes' declarations; this file only steps them.

Muon is torch.optim.Muon (PyTorch >= 2.9): momentum, Newton-Schulz orthogonalisation of the (Nesterov)
momentum, a shape-dependent LR adjustment and decoupled weight decay. Two things train.py needs that it
does not do, added here:
- the non-finite-step skip. Fused AdamW skips a step on the device when handed found_inf; torch's Muon
  has no such flag, so SkippingMuon keeps a copy of its parameters and momentum buffers and, after the
  step, puts them back where found_inf > 0 (torch.where on the device: no host sync);
- one optimizer object for two: MuonAdamW is one torch Optimizer over both's parameter groups (the same
  dicts), so the LR schedule, zero_grad, GradScaler.unscale_, step hooks and checkpoints see one optimizer.
"""

import torch


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
