"""Parameters a module keeps in float32 whatever the model's dtype, as HF keeps them (its
``_keep_in_fp32_modules``): a router's gate, a selection bias, a decay's time-step bias."""

from __future__ import annotations

import torch


class Float32Params:
    """Mixed into an ``nn.Module`` before it: the parameters named in ``float32_params`` stay
    float32 through ``.to(dtype)`` and the like."""

    float32_params: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        for name in self.float32_params:
            p = getattr(self, name)
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return out
