"""Pure-torch checks behind tier 1: loss terms, gradient norms, clipping.

Nothing here knows about MMEngine; :mod:`mmnanhook.optim_wrapper` adapts it.
The hot path builds tensors only; values reach the host in one sync chosen
by the caller, and names and per-term floats are computed on the failure
path only.
"""
import math
from collections import OrderedDict

import torch

from . import compat

# How many offending names an event message and ``nonfinite_grads`` keep.
MAX_NAMES = 20

TRIGGERS = ('loss', 'grad', 'exception', 'amp_scale')

# torch's anomaly mode reports the forward traceback as a warning that starts
# with this text (torch 1.7 through 2.13).
_ANOMALY_WARNING = 'Error detected in '


class NonFiniteEvent(object):
    """What was non-finite in one update step, handed to listeners.

    Args:
        trigger (str): One of :data:`TRIGGERS`.
        message (str): Human-readable description (built by the caller).
        iter (int, optional): Global training iteration of the update step.
        epoch (int, optional): Training epoch.
        rank (int): Rank that builds the event.
        world_size (int): Number of ranks.
        bad_ranks (list[int]): Ranks whose loss was non-finite.
        losses (dict): Loss term name -> float (non-finite values kept).
        nonfinite_losses (list[str]): Names of the non-finite loss terms.
        bad_loss_iters (list[int]): Iterations (micro-steps under gradient
            accumulation) whose loss was non-finite on this rank.
        grad_norm (float, optional): Total gradient norm before clipping,
            unscaled under AMP.
        nonfinite_grads (list[str]): Parameters with non-finite gradients,
            at most :data:`MAX_NAMES`.
        nonfinite_grad_count (int): How many parameters have them.
        loss_scale (float, optional): AMP loss scale used for the step.
        exception (BaseException, optional): The exception raised in
            backward, for ``trigger='exception'``.
        forward_traceback (str, optional): Anomaly mode's traceback of the
            forward op involved, when it was on.
    """

    def __init__(self, trigger, message, iter=None, epoch=None, rank=0,
                 world_size=1, bad_ranks=None, losses=None,
                 nonfinite_losses=None, bad_loss_iters=None, grad_norm=None,
                 nonfinite_grads=None, nonfinite_grad_count=0,
                 loss_scale=None, exception=None, forward_traceback=None):
        if trigger not in TRIGGERS:
            raise ValueError('unknown trigger %r' % (trigger, ))
        self.trigger = trigger
        self.message = message
        self.iter = iter
        self.epoch = epoch
        self.rank = rank
        self.world_size = world_size
        self.bad_ranks = list(bad_ranks or [])
        self.losses = dict(losses or {})
        self.nonfinite_losses = list(nonfinite_losses or [])
        self.bad_loss_iters = list(bad_loss_iters or [])
        self.grad_norm = grad_norm
        self.nonfinite_grads = list(nonfinite_grads or [])
        self.nonfinite_grad_count = nonfinite_grad_count
        self.loss_scale = loss_scale
        self.exception = exception
        self.forward_traceback = forward_traceback

    def __repr__(self):
        return 'NonFiniteEvent(%s)' % self.message


def loss_terms(log_vars):
    """The entries of a parsed loss dict that ``parse_losses`` sums.

    Args:
        log_vars (Mapping[str, torch.Tensor]): ``parse_losses``' second
            output (including the total under ``'loss'``).

    Returns:
        OrderedDict: name -> detached tensor, for the keys containing
        ``'loss'`` (the sum's terms and the total); other entries, such as an
        accuracy, are not losses.
    """
    return OrderedDict((k, v.detach()) for k, v in log_vars.items()
                       if 'loss' in k and torch.is_tensor(v))


def describe_losses(terms):
    """Turn loss terms into floats and name the non-finite ones.

    Failure path only: every term costs a host sync.

    Args:
        terms (Mapping[str, torch.Tensor]): From :func:`loss_terms`.

    Returns:
        tuple[dict, list[str]]: name -> float, and the non-finite names. The
        total ``'loss'`` is named only when no term explains it.
    """
    values = OrderedDict((k, float(v.float().mean())) for k, v in terms.items())
    bad = [k for k, v in values.items() if not math.isfinite(v)]
    if len(bad) > 1 and 'loss' in bad:
        bad.remove('loss')
    return values, bad


# Gradients whose 2-norm the fast path takes from a dot product.
_DOT_DTYPES = (torch.float32, torch.float64)


class GradNorms(object):
    """Per-tensor and total p-norms of gradients, computed once.

    With ``exact=True`` the total is computed the way
    ``torch.nn.utils.clip_grad_norm_`` computes it (bitwise equal on the
    torch versions whose clip :mod:`mmnanhook.compat` mirrors), so clipping
    can reuse it. Without, the norm only has to be right to a few ulps: torch
    before 2.0, whose per-tensor norm kernels are slow on CPU, then gets the
    2-norm from dot products, about 4x faster; newer torch uses the fused
    ``_foreach_norm`` either way.

    Args:
        grads (list[torch.Tensor]): Gradient tensors.
        norm_type (float | str): The ``p`` of the norm; ``'inf'`` allowed.
        exact (bool): Compute the total exactly as the clip does.
    """

    def __init__(self, grads, norm_type=2.0, exact=True):
        self.grads = list(grads)
        self.norm_type = float(norm_type)
        self.order = []
        # Per gradient, a value that is non-finite iff its norm is.
        self._partials = []
        squares = (not exact and self.norm_type == 2.0
                   and not compat.FOREACH_NORM_IN_CLIP
                   and all(g.dtype in _DOT_DTYPES for g in self.grads))
        with torch.no_grad():
            groups = compat.clip_norm_groups(self.grads)
            # Grouped and summed in the order torch's clip uses.
            for group in groups:
                tensors = [self.grads[i] for i in group]
                if squares:
                    flat = [t.reshape(-1) for t in tensors]
                    self._partials.extend(torch.dot(f, f) for f in flat)
                elif compat.foreach_norm_supported(tensors,
                                                   tensors[0].device):
                    self._partials.extend(
                        torch._foreach_norm(tensors, self.norm_type))
                else:
                    self._partials.extend(
                        compat.clip_vector_norm(t, self.norm_type)
                        for t in tensors)
                self.order.extend(group)
            if not self._partials:
                self.total = torch.tensor(0.0)
                return
            partials = self._partials
            if len(groups) > 1:
                device = self.grads[0].device
                partials = [t.to(device) for t in partials]
            stacked = torch.stack(partials)
            if squares:
                self.total = stacked.sum().sqrt()
            else:
                self.total = compat.clip_vector_norm(stacked, self.norm_type)

    def nonfinite(self):
        """Indices (into ``grads``) of gradients holding NaN or Inf.

        Failure path only (host syncs). Only gradients whose own norm is not
        finite are inspected element-wise.
        """
        if not self._partials:
            return []
        device = self.total.device
        values = torch.stack([t.to(device).float()
                              for t in self._partials]).tolist()
        suspects = [self.order[k] for k, v in enumerate(values)
                    if not math.isfinite(v)]
        if not suspects:
            return []
        finite = torch.stack([
            torch.isfinite(self.grads[i]).all().to(device) for i in suspects
        ]).tolist()
        return sorted(i for i, ok in zip(suspects, finite) if not ok)

    def largest_abs(self):
        """The largest gradient magnitude, as a float (failure path)."""
        if not self.grads:
            return 0.0
        device = self.total.device
        return float(
            torch.stack([
                g.detach().abs().max().float().to(device) for g in self.grads
            ]).max())


def clip_grads_with_norm_(params, max_norm, total_norm):
    """Scale gradients in place by ``min(max_norm / (total + 1e-6), 1)``.

    The second half of ``clip_grad_norm_``, given the norm it would have
    computed, so clipping costs no second pass over the gradients' norms.

    Args:
        params (list[torch.Tensor]): Parameters whose ``.grad`` is scaled.
        max_norm (float): Maximum norm.
        total_norm (torch.Tensor): Total norm, e.g. :attr:`GradNorms.total`.
    """
    if compat.clip_grads_with_norm_ is not None:
        compat.clip_grads_with_norm_(params, max_norm, total_norm)
        return
    # torch < 2.6: the same arithmetic as its clip_grad_norm_.
    clip_coef = float(max_norm) / (total_norm + 1e-6)
    if compat.CLIP_ALWAYS_MULTIPLIES:
        clip_coef = torch.clamp(clip_coef, max=1.0)
    elif not clip_coef < 1:
        return
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(clip_coef.to(p.grad.device))


def anomaly_traceback(caught):
    """Anomaly mode's forward traceback among recorded warnings.

    Args:
        caught (list[warnings.WarningMessage]): From
            ``warnings.catch_warnings(record=True)`` around a backward.

    Returns:
        tuple[str | None, list]: The traceback text (``None`` when anomaly
        mode reported none) and the other warnings, to be re-emitted.
    """
    texts, others = [], []
    for w in caught:
        text = str(w.message)
        if text.startswith(_ANOMALY_WARNING):
            texts.append(text)
        else:
            others.append(w)
    return ('\n'.join(texts) if texts else None), others


def is_anomaly_nan_error(exc):
    """Whether ``exc`` is anomaly mode's "returned nan values" error."""
    return isinstance(exc, RuntimeError) and 'returned nan values' in str(exc)


def format_names(names, count):
    """``'a, b, c'``, with ``' and N more'`` when ``count`` exceeds them."""
    text = ', '.join(names)
    if count > len(names):
        text += ' and %d more' % (count - len(names))
    return text


def format_value(value):
    """A float for messages: ``nan``/``inf`` as such, else 6 significant.

    Strings pass through: strict JSON (``report.json``) stores non-finite
    floats as ``"nan"``, ``"inf"``, ``"-inf"``.
    """
    if value is None:
        return 'n/a'
    if isinstance(value, str):
        return value
    if not math.isfinite(value):
        return str(value)
    return '%.6g' % value
