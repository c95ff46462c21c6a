"""SyncBatchNorm: batch statistics over the global batch of all workers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .. import api as _api
from .ops import allgather


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, name):
        c = x.shape[1]
        xf = x.transpose(0, 1).reshape(c, -1).float()
        count = torch.tensor([float(xf.shape[1])])
        mean = xf.mean(1)
        var = xf.var(1, unbiased=False)
        # Like Horovod: gather every worker's (count, mean, var) and combine,
        # which handles uneven per-worker batches.
        stats = torch.cat([count, mean, var]).unsqueeze(0)
        allstats = allgather(stats, name=f"{name}.stats")
        counts, means, vars_ = allstats[:, :1], allstats[:, 1:c + 1], allstats[:, c + 1:]
        total = counts.sum()
        g_mean = (counts * means).sum(0) / total
        g_var = (counts * (vars_ + (means - g_mean) ** 2)).sum(0) / total
        invstd = torch.rsqrt(g_var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(momentum * g_mean.to(running_mean.dtype))
                unbiased = g_var * total / max(total.item() - 1, 1)
                running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        shape = [1, c] + [1] * (x.dim() - 2)
        xhat = (x.float() - g_mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.float().view(shape) + bias.float().view(shape)
        ctx.save_for_backward(xhat, weight, invstd, total)
        ctx.name = name
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd, total = ctx.saved_tensors
        c = dy.shape[1]
        shape = [1, c] + [1] * (dy.dim() - 2)
        dyf = dy.float()
        dims = [0] + list(range(2, dy.dim()))
        sum_dy = dyf.sum(dims)
        sum_dy_xhat = (dyf * xhat).sum(dims)
        both = allgather(torch.cat([sum_dy, sum_dy_xhat]).unsqueeze(0), name=f"{ctx.name}.grad").sum(0)
        g_sum_dy, g_sum_dy_xhat = both[:c], both[c:]
        w = weight.float().view(shape) if weight is not None else 1.0
        dx = (dyf - g_sum_dy.view(shape) / total - xhat * g_sum_dy_xhat.view(shape) / total) * invstd.view(shape) * w
        dweight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        dbias = sum_dy.to(weight.dtype) if weight is not None else None
        return dx.to(dy.dtype), dweight, dbias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for torch.nn.SyncBatchNorm: in training, mean and variance are
    computed over the combined batch of every worker. Each worker's weight and
    bias gradients are local sums, as with torch.nn.SyncBatchNorm (the
    DistributedOptimizer then reduces them like any other gradient)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self._gh_name = _api.auto_name("sync_batch_norm", persistent=True)

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x):
        self._check_input_dim(x)
        if not self.training or not _api.is_initialized() or _api.size() == 1:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                self.training or not self.track_running_stats, self.momentum or 0.0, self.eps)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFn.apply(x, self.weight, self.bias, self.running_mean if self.track_running_stats else None,
                                      self.running_var if self.track_running_stats else None, self.eps, momentum,
                                      self._gh_name)
