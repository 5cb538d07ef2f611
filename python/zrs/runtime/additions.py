"""Parameters registered into a sharded model after zrs sharded it: `Additions`.

`get_peft_model` on a model that zrs already sharded, or a trainable adapter loaded into one,
registers parameters that zrs never sharded: their gradients are nobody's to reduce, so each
rank would train a copy of its own, apart from the others, without an error. torch's
process-wide module registration hooks (`handles.LIVE` installs them) report each registration;
a model's `Additions` keeps those into its own modules, and its state refuses an optimizer step
that would update one. The step, not the registration: PEFT registers a second adapter's weights
requiring gradients and freezes them only afterwards, and a frozen adapter (inference; the same
file on every rank) is allowed.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn


class Additions:
    """One model's later parameters, weakly (docs/integrations.md)."""

    def __init__(self) -> None:
        # The model's modules, learned at the first registration anywhere after it is sharded,
        # so that steady training pays nothing; then the modules registered into them.
        self.members: weakref.WeakSet[nn.Module] | None = None
        self.added: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> the parameter

    def note(self, root: nn.Module, module: nn.Module, value: nn.Module | torch.Tensor) -> None:
        """`value` (a parameter or a submodule) was registered on `module`."""
        if self.members is None:
            self.members = weakref.WeakSet(root.modules())
        if module not in self.members:
            return
        if isinstance(value, nn.Module):
            self.members.update(value.modules())
            params = list(value.parameters())
        else:
            params = [value]
        for p in params:
            self.added[id(p)] = weakref.ref(p)

    def refusal(
        self, root: nn.Module, optimizer: torch.optim.Optimizer, sharded: set[int]
    ) -> str | None:
        """Why `optimizer`'s step must not run: it would update parameters added after the
        sharding (a gradient, and not one of the `sharded` ids); None when it may."""
        if not self.added:
            return None
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
        added = {
            i
            for i, ref in self.added.items()
            if i in stepped and i not in sharded and ref() is not None
        }
        if not added:
            return None
        names = [n for n, p in root.named_parameters() if id(p) in added]
        more = ", ..." if len(names) > 4 else ""
        return (
            f"the optimizer is about to update {len(added)} parameter(s) added to the model "
            f"after zrs sharded it ({', '.join(names[:4]) or 'unnamed'}{more}): zrs neither "
            "shards them nor averages their gradients across the ranks, so each rank would "
            "train a copy of its own. Add them before zrs.shard or zrs.compile (PEFT: "
            "zrs.shard(get_peft_model(model, config)), and load_adapter(..., is_trainable=True) "
            "before sharding), or keep them frozen"
        )
