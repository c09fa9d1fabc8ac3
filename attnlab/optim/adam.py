"""Adam and AdamW stepping FSDP2 (DTensor) parameters through their local shards; the "adamw" and "adam" optimizers.

The update is elementwise, so it is the same arithmetic on the same shards, minus DTensor's dispatch of every
fused/foreach call, which left stock AdamW on FSDP2 shards host-bound (host time several times its GPU time).
Parameters and state stay DTensors, so state dicts and DCP checkpoints are unchanged.
"""

from __future__ import annotations

import torch

from attnlab.optim.dtensor import local_shard
from attnlab.optim.registry import RoleSettings, Stepper, register_optimizer


class _ShardLocalStep:
    """Mixin for torch's Adam/AdamW: the tensor lists a step works on hold the parameters' local shards."""

    def _init_group(self, group, *lists):
        has_complex = super()._init_group(group, *lists)
        for lst in lists:
            lst[:] = [local_shard(t) for t in lst]
        return has_complex


class Adam(_ShardLocalStep, torch.optim.Adam):
    pass


class AdamW(_ShardLocalStep, torch.optim.AdamW):
    pass


def adam_stepper(cls: type[torch.optim.Optimizer], cfg, roles: dict[str, RoleSettings],
                 betas: tuple[float, float], eps: float) -> Stepper:
    """A stepper of ``roles`` built as ``cls`` (:class:`Adam` or :class:`AdamW`) with ``betas`` and ``eps``;
    ``optimizer.implementation`` "fused" runs fused on CUDA and foreach elsewhere."""

    def make(param_groups: list[dict], routes) -> torch.optim.Optimizer:
        on_cuda = all(r.param.device.type == "cuda" for r in routes)
        impl = cfg.implementation
        return cls(param_groups, lr=cfg.lr, betas=betas, eps=eps, fused=impl == "fused" and on_cuda,
                   foreach=impl == "foreach" or (impl == "fused" and not on_cuda))

    return Stepper(roles, make)


def _every_role(cfg) -> dict[str, RoleSettings]:
    """optimizer.lr everywhere; weight decay on matrices, and on embeddings and an untied head with
    ``embed_weight_decay``."""
    lr, wd = cfg.lr, cfg.weight_decay
    embed_wd = wd if cfg.embed_weight_decay else 0.0
    return {"matrix": RoleSettings(lr, wd), "embed": RoleSettings(lr, embed_wd), "head": RoleSettings(lr, embed_wd),
            "norm": RoleSettings(lr, 0.0), "vector": RoleSettings(lr, 0.0)}


@register_optimizer("adamw")
def adamw(cfg) -> list[Stepper]:
    """AdamW (decoupled weight decay; beta1, beta2, eps) for every role."""
    return [adam_stepper(AdamW, cfg, _every_role(cfg), (cfg.beta1, cfg.beta2), cfg.eps)]


@register_optimizer("adam")
def adam(cfg) -> list[Stepper]:
    """Adam (weight decay added to the gradient; beta1, beta2, eps) for every role."""
    return [adam_stepper(Adam, cfg, _every_role(cfg), (cfg.beta1, cfg.beta2), cfg.eps)]
