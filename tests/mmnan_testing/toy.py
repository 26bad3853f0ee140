"""A toy model on a real MMEngine Runner: tier-1 tests with mmengine only.

Faults are planted per sample: with ``DefaultSampler(shuffle=False)`` and
batch size 2 (:data:`BATCH`), sample ``2k`` / ``2k + 1`` is in iteration
``k``.
"""
import copy
import glob
import os.path as osp
import uuid

import torch
import torch.nn as nn
from mmengine.evaluator import BaseMetric
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.runner import Runner
from torch.utils.data import Dataset

from mmnanhook.errors import NonFiniteError
from mmnanhook.memory import capture_rng
from mmnanhook.sentinel import sentinel_of
from .faults import NanGradient

BATCH = 2

# True while dynamo traces, where torch has it (2.3+); never on older torch.
_compiling = getattr(getattr(torch, 'compiler', None), 'is_compiling',
                     lambda: False)

# The wrapper methods the install binds onto the instance.
BOUND = ('update_params', 'backward', 'step', '_clip_grad', 'optim_context')


class ToyDataset(Dataset):
    """``n`` random 4-vectors; ``faults`` maps a sample index to a fault.

    The fault ``nan_input`` makes the sample's input all NaN (the data
    itself is bad: tier 1's input check stops it before the forward); the
    others act in the model.
    """

    metainfo = dict(name='toy')

    def __init__(self, n=16, faults=None):
        g = torch.Generator().manual_seed(0)
        faults = faults or {}
        self.items = []
        for i in range(n):
            inputs = torch.randn(4, generator=g)
            fault = faults.get(i, '')
            if fault == 'nan_input':
                inputs = torch.full_like(inputs, float('nan'))
            self.items.append(dict(inputs=inputs, fault=fault))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


class NanRows(nn.Module):
    """Makes rows of its (finite) input NaN: a NaN the model makes, as a log
    of 0 would; the diagnosis finds it made here."""

    def forward(self, x, rows):
        x = x.clone()
        x[rows] = float('nan')
        return x


def _rows(fault, name):
    """The batch positions of the samples whose fault is ``name``."""
    return [i for i, f in enumerate(fault or []) if f == name]


class ToyModel(BaseModel):
    """Two linear layers and two loss terms; faults come with the data.

    Faults: ``nan_term`` (loss_aux NaN), ``inf_target`` (loss_aux inf with
    finite gradients), ``nan_grad`` (NaN gradient of ``head.bias`` only),
    ``huge_grad`` (finite gradients whose float32 norm overflows),
    ``inplace`` (an in-place write that breaks backward), ``compiled_only``
    (loss_aux NaN where torch.compile traces the forward, finite eagerly),
    ``overflow`` /
    ``overflow_hard`` (finite loss, but a loss-scaled backward overflows
    into NaN: once at scale 2**16, or down to scale 2), ``spike`` (a finite
    loss a thousand times the usual), ``raise_in_loss`` (the model makes
    the sample's predictions NaN, on which its loss raises, as SimOTA's
    ``binary_cross_entropy`` of NaN scores does), ``nan_made`` (the model
    makes the sample's features NaN before ``features``); both with
    :class:`NanRows` from finite data.
    """

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 1)
        self.amp_w = nn.Parameter(torch.ones(2))
        self.nan_rows = NanRows()
        self.anomaly_seen = []

    def forward(self, inputs, fault=None, mode='tensor'):
        self.anomaly_seen.append((mode, torch.is_anomaly_enabled()))
        faults = set(f for f in (fault or []) if f)
        x = torch.stack(inputs)
        if _rows(fault, 'nan_made'):
            x = self.nan_rows(x, _rows(fault, 'nan_made'))
        x = self.features(x)
        h = self.fc(x)
        if 'inplace' in faults:
            h = h.sigmoid()
            out = h * 2
            h.add_(1)  # modifies what sigmoid's backward needs
            h = out
        bias = self.head.bias
        if 'nan_grad' in faults:
            bias = NanGradient.apply(bias)
        y = nn.functional.linear(h, self.head.weight, bias)
        if mode != 'loss':
            return y
        if _rows(fault, 'raise_in_loss'):
            y = self.nan_rows(y, _rows(fault, 'raise_in_loss'))
        return self.loss(y, faults)

    def loss(self, y, faults):
        """The loss terms of the predictions ``y`` of a batch with
        ``faults`` (a set)."""
        if 'raise_in_loss' in faults:
            # Raises on NaN probabilities (CPU kernels check the range).
            nn.functional.binary_cross_entropy(
                torch.sigmoid(y), torch.zeros_like(y))
        target = 1.0
        if 'inf_target' in faults:
            target = float('inf')
        loss_aux = (y - target).abs().mean()
        if 'nan_term' in faults:
            loss_aux = loss_aux * float('nan')
        if 'compiled_only' in faults and _compiling():
            # As a backend's miscompilation: only the compiled code makes it.
            loss_aux = loss_aux * float('nan')
        loss_main = y.pow(2).mean()
        if 'huge_grad' in faults:
            loss_main = loss_main * 1e30
        if 'spike' in faults:
            # Finite, but far above any band of this model's losses.
            loss_main = loss_main * 1e3 + 1e3
        # Zero in value; 2**16 * 1e34 overflows float32 in backward and
        # inf * 0 turns into NaN in the MulBackward of amp_w * 0.
        big = 0.0
        if 'overflow' in faults:
            big = 1e34
        if 'overflow_hard' in faults:
            big = 1e38
        loss_main = loss_main + (self.amp_w * torch.zeros(2) * big).sum()
        return dict(loss_main=loss_main, loss_aux=loss_aux,
                    acc=torch.tensor(float('nan')))

    def features(self, x):
        """What ``fc`` sees: the inputs themselves."""
        return x


class ToyBNModel(ToyModel):
    """:class:`ToyModel` whose inputs first go through BatchNorm in train
    mode (every forward updates its running statistics, as with
    ``norm_eval=False``) and dropout (every forward draws random numbers):
    a step done again from the wrong buffers or RNG state differs.

    The BatchNorm normalizes the 4 features of each sample as one channel,
    so that a batch of one sample trains too.
    """

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(1)
        self.dropout = nn.Dropout(0.5)

    def features(self, x):
        return self.dropout(self.bn(x.unsqueeze(1)).squeeze(1))


class ToySyncBNModel(ToyModel):
    """:class:`ToyModel` whose inputs first go through
    :class:`~mmnanhook.drill.CpuSyncBatchNorm` (the 4 features of
    each sample as one channel): under DDP every training forward shares
    its batch statistics with the other ranks, so one rank's NaN features
    (``nan_made``) make every rank's loss NaN."""

    def __init__(self):
        super().__init__()
        from mmnanhook.drill import CpuSyncBatchNorm
        self.bn = CpuSyncBatchNorm(1)

    def features(self, x):
        return self.bn(x.unsqueeze(1)).squeeze(1)


class ToyNormalizedModel(ToyModel):
    """:class:`ToyModel` whose main loss is normalized by the batch size
    averaged over the ranks, as mmdet's heads divide by ``reduce_mean(
    num_pos)``: under DDP a collective every forward calls after the point
    where a bad sample's loss raises (``raise_in_loss``).

    Args:
        before (int): Averages taken before that point, as mmdet's DINO
            takes one per loss term and decoder layer (only the last
            normalizes).
        after (int): Those taken after it (at least one).
    """

    def __init__(self, before=0, after=1):
        super(ToyNormalizedModel, self).__init__()
        self.before, self.after = before, after

    def loss(self, y, faults):
        import torch.distributed as dist
        count = torch.tensor(float(y.shape[0]))

        def reduce_mean():
            mean = count.clone()
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(mean.div_(dist.get_world_size()))
            return mean

        for _ in range(self.before):
            reduce_mean()
        losses = super(ToyNormalizedModel, self).loss(y, faults)
        for _ in range(self.after):
            mean = reduce_mean()
        losses['loss_main'] = losses['loss_main'] * (y.shape[0] / mean)
        return losses


class TwoOptimizerModel(ToyModel):
    """Updates ``fc`` and ``head`` with their own wrappers (GAN-style): an
    ``OptimWrapperDict`` of :func:`two_optimizers`."""

    def train_step(self, data, optim_wrapper):
        data = self.data_preprocessor(data, True)
        losses = self(**data, mode='loss')
        parsed, log_vars = self.parse_losses(losses)
        optim_wrapper['head'].update_params(parsed)
        losses = self(**data, mode='loss')
        optim_wrapper['fc'].update_params(losses['loss_aux'])
        return log_vars


def two_optimizers(model):
    """The optim wrappers of a :class:`TwoOptimizerModel` (for
    ``make_runner``'s ``optim_wrapper``)."""
    return dict(
        fc=OptimWrapper(torch.optim.SGD(model.fc.parameters(), lr=0.1)),
        head=OptimWrapper(torch.optim.SGD(
            list(model.head.parameters()) + [model.amp_w], lr=0.1)))


class Probe(Hook):
    """Snapshots parameters and optimizer state around each train iteration;
    buffers and RNG states too.
    """

    priority = 'VERY_LOW'

    def __init__(self):
        self.before = {}
        self.after = {}
        self.buffers_before = {}
        self.buffers_after = {}
        # Captured last before the train step: its forward's RNG states.
        self.rng = {}
        self.wrapper_types = []

    def _snapshot(self, runner):
        params = {n: p.detach().clone()
                  for n, p in runner.model.named_parameters()}
        return params, copy.deepcopy(runner.optim_wrapper.state_dict())

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.before[runner.iter] = self._snapshot(runner)
        self.buffers_before[runner.iter] = buffers(runner)
        self.rng[runner.iter] = capture_rng()
        ow = runner.optim_wrapper
        members = ow.values() if isinstance(ow, OptimWrapperDict) else [ow]
        self.wrapper_types.append(
            (type(ow).__name__, [(type(m).__name__, sentinel_of(m) is not None)
                                 for m in members]))

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        self.after[runner.iter] = self._snapshot(runner)
        self.buffers_after[runner.iter] = buffers(runner)


def make_runner(tmp_path, faults=None, hook=None, optim_wrapper=None,
                max_iters=4, n=16, model=None, probe=None, val=False,
                log_level='WARNING', **kwargs):
    """A Runner training the toy model for ``max_iters`` iterations.

    Args:
        hook (dict | Hook | None): Put in ``custom_hooks`` (with ``probe``).
        optim_wrapper (dict | callable, optional): Config, or a function of
            the model returning a built wrapper.
        val (bool): Add a val loop after every 2 iterations.
    """
    model = model if model is not None else ToyModel()
    if callable(optim_wrapper):
        optim_wrapper = optim_wrapper(model)
    elif optim_wrapper is None:
        optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1,
                                            momentum=0.9))
    custom_hooks = [h for h in (hook, probe) if h is not None]
    loader = dict(dataset=ToyDataset(n, faults),
                  sampler=dict(type='DefaultSampler', shuffle=False),
                  batch_size=BATCH, num_workers=0,
                  collate_fn=dict(type='pseudo_collate'))
    if val:
        kwargs.update(
            val_dataloader=dict(loader, dataset=ToyDataset(4)),
            val_cfg=dict(), val_evaluator=[ToyMetric()])
    return Runner(
        model=model, work_dir=str(tmp_path),
        experiment_name='toy_' + uuid.uuid4().hex,
        train_dataloader=loader,
        train_cfg=dict(by_epoch=False, max_iters=max_iters,
                       val_interval=2),
        optim_wrapper=optim_wrapper, custom_hooks=custom_hooks,
        default_hooks=kwargs.pop('default_hooks', dict(checkpoint=None)),
        log_level=log_level,
        default_scope='mmengine', randomness=dict(seed=0), **kwargs)


class ToyMetric(BaseMetric):

    def process(self, data_batch, data_samples):
        self.results.append(0.0)

    def compute_metrics(self, results):
        return dict(zero=0.0)


def params(runner):
    """Copies of the runner's model parameters, by name."""
    return {n: p.detach().clone() for n, p in runner.model.named_parameters()}


def buffers(runner):
    """Copies of the runner's model buffers, by name."""
    return {n: b.detach().clone() for n, b in runner.model.named_buffers()}


def assert_same(a, b):
    """Assert two name -> tensor dicts are bitwise equal."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_state_same(a, b):
    """Assert two (nested) state dicts are bitwise equal."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_state_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_state_same(x, y)
    else:
        assert a == b


def log_text(runner):
    """Everything the runner's log files hold."""
    paths = glob.glob(osp.join(runner.log_dir, '*.log'))
    return ''.join(open(p).read() for p in paths)


def train_error(runner):
    """Train; return the ``NonFiniteError`` that stopped it.

    Raises:
        AssertionError: When training ended without one.
    """
    try:
        runner.train()
    except NonFiniteError as exc:
        return exc
    raise AssertionError('training did not raise NonFiniteError')
