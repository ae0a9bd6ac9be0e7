"""LAMB and LARS as plain torch code, following meshtrain's README formulas (Debian's torch
has neither). A "parameter" is one torch Parameter: one Hugging Face tensor.

LAMB: m, v as Adam's; u = m^ / (sqrt(v^) + eps) + wd w; r = ||w|| / ||u|| (1 when either
norm is 0); w -= lr r u. Weight decay is the param group's (0 for 1-dim parameters).

LARS: for a group with adapt=True (2+ dims) and ||w||, ||g|| > 0:
d = s (g + wd w), s = trust_coef ||w|| / (||g|| + wd ||w|| + eps); otherwise d = g. Then
buf = d on the first step, else momentum buf + d; w -= lr buf (Nesterov: lr (d + momentum buf)).
"""
import torch


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr, betas, eps, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), eps, wd, lr = group["betas"], group["eps"], group["weight_decay"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["t"] += 1
                t, m, v, g = st["t"], st["m"], st["v"], p.grad
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) + wd * p
                wn, un = float(torch.linalg.vector_norm(p)), float(torch.linalg.vector_norm(u))
                p.sub_(u, alpha=lr * self.trust_ratio(wn, un))

    @staticmethod
    def trust_ratio(w_norm, u_norm):
        return w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0


class Lars(torch.optim.Optimizer):
    def __init__(self, params, lr, momentum, weight_decay, trust_coef, eps, nesterov=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coef=trust_coef, eps=eps, nesterov=nesterov, adapt=True))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            mom, wd, lr = group["momentum"], group["weight_decay"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                wn, gn = float(torch.linalg.vector_norm(p)), float(torch.linalg.vector_norm(g))
                if group["adapt"] and wn > 0 and gn > 0:
                    d = (g + wd * p) * (group["trust_coef"] * wn / (gn + wd * wn + group["eps"]))
                else:
                    d = g.clone()
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = d.clone()
                else:
                    st["buf"].mul_(mom).add_(d)
                p.sub_(d + mom * st["buf"] if group["nesterov"] else st["buf"], alpha=lr)
