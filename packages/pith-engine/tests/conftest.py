"""Multi-process (gloo) test support (run_ranks itself is in the repository's conftest.py)."""

import pytest
import torch
from torch.distributed.tensor import DTensor


class ScaledAdamW(torch.optim.AdamW):
    """torch's AdamW with the step's `grad_scale` (the clip coefficient that pith_engine.step.train_step
    hands the optimizer, as pith_train.optim.AdamW takes it) applied to the gradients first."""

    def step(self, closure=None, grad_scale=None):
        if grad_scale is not None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                        g.mul_(grad_scale)
        return super().step(closure)


@pytest.fixture
def scaled_adamw():
    return ScaledAdamW
