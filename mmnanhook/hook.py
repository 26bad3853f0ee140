"""``NanDetectHook``: the MMEngine entry point of mmnanhook.

``custom_hooks = [dict(type='NanDetectHook')]`` is all a config needs. In
``before_train`` the hook installs the checks of
:mod:`mmnanhook.optim_wrapper` into the optim wrapper the runner built and
wraps the model's ``train_step`` (anomaly mode around exactly the train
iteration) and ``parse_losses`` (so a trigger can name the loss term); all of
it is undone in ``after_train`` or when a train step raises.
"""
import collections
import functools
import logging
import os

import torch
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS

from . import checks, compat
from .history import History
from .incident import default_dump_dir, handle_incident
from .optim_wrapper import install_nan_detect, validate_options
from .rng import capture_rng

ANOMALY_MODES = ('on_trigger', 'always', 'never')


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _check_anomaly(anomaly):
    if anomaly in ANOMALY_MODES:
        return
    if not _is_count(anomaly) or anomaly < 0:
        raise ValueError(
            'anomaly must be one of %s or an int >= 0 (anomaly mode on for '
            'that many train iterations), got %r' %
            (', '.join(map(repr, ANOMALY_MODES)), anomaly))


def _check_count(name, value, minimum):
    if not _is_count(value) or value < minimum:
        raise ValueError('%s must be an int >= %d, got %r' %
                         (name, minimum, value))


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError('%s must be True or False, got %r' % (name, value))


@HOOKS.register_module()
class NanDetectHook(Hook):
    """Stop every non-finite loss or gradient before the optimizer step.

    Args:
        anomaly (str | int): ``'on_trigger'`` (default: anomaly mode off in
            train iterations; the tier-2 replay uses it), ``'always'``,
            ``'never'`` (not even in the replay), or an int N: on for the
            first N train iterations of the run, then ``'on_trigger'``.
            Anomaly mode is set only around train iterations and restored
            afterwards.
        policy (str): What a trigger does: ``'raise'`` (default) a
            :class:`~mmnanhook.NonFiniteError`; ``'skip'`` the update step
            (parameters and optimizer state unchanged, gradients zeroed);
            ``'warn'`` log and step as MMEngine would have.
        max_skips (int): Consecutive skipped update steps after which
            ``'skip'`` raises. Defaults to 10.
        min_loss_scale (float, optional): Under AMP, a loss scale below this
            is a trigger. Defaults to 1; ``None`` disables it.
        max_overflow_skips (int, optional): Under AMP, more consecutive
            overflow skips than this are a trigger. Defaults to 20; ``None``
            disables it.
        dump_dir (str, optional): Where bundles are written; defaults to
            ``{work_dir}/nan_dumps``.
        max_dumps (int): Bundles kept per rank (newest first); 0 writes
            none. Defaults to 5.
        replay (bool): Replay the failing iteration to diagnose it.
            Defaults to True.
        history (int): Iterations of loss / grad-norm / lr / loss-scale
            history kept for the bundle. Defaults to 200.
        dump_optimizer (bool): Put the optimizer state in bundles. Defaults
            to True.

    Raises:
        ValueError: For a bad option, naming it.

    Example:
        >>> custom_imports = dict(imports=['mmnanhook'],
        ...                       allow_failed_imports=False)
        >>> custom_hooks = [dict(type='NanDetectHook', policy='skip')]
    """

    priority = 'ABOVE_NORMAL'

    def __init__(self,
                 anomaly='on_trigger',
                 policy='raise',
                 max_skips=10,
                 min_loss_scale=1.0,
                 max_overflow_skips=20,
                 dump_dir=None,
                 max_dumps=5,
                 replay=True,
                 history=200,
                 dump_optimizer=True):
        _check_anomaly(anomaly)
        self.options = validate_options(policy, max_skips, min_loss_scale,
                                        max_overflow_skips)
        if dump_dir is not None and not isinstance(dump_dir,
                                                   (str, os.PathLike)):
            raise ValueError('dump_dir must be a path or None, got %r' %
                             (dump_dir, ))
        _check_count('max_dumps', max_dumps, 0)
        _check_bool('replay', replay)
        _check_count('history', history, 0)
        _check_bool('dump_optimizer', dump_optimizer)
        self.anomaly = anomaly
        self.dump_dir = dump_dir
        self.max_dumps = max_dumps
        self.replay = replay
        self.history = history
        self.dump_optimizer = dump_optimizer
        self._handle = None
        self._patches = []
        self._parsed = None
        self._train_iters = 0
        # iter -> (raw batch, RNG state before its forward) of the micro-steps
        # since the last update step: the bad loss may be an earlier one's.
        self._steps = collections.OrderedDict()
        self._max_steps = 1
        self._history = History(maxlen=history)
        self._buffers = []
        self._runner = None
        self._logger = None

    # -- lifecycle ---------------------------------------------------------

    def before_train(self, runner):
        self._restore()
        self._handle = install_nan_detect(
            runner.optim_wrapper, listener=self,
            message_hub=runner.message_hub, **self.options)
        self._train_iters = 0
        model = runner.model
        self._patch(model, 'train_step',
                    self._wrap_train_step(runner, model.train_step))
        module = model.module if is_model_wrapper(model) else model
        self._patch(module, 'parse_losses',
                    self._wrap_parse_losses(module.parse_losses))
        self._max_steps = max(
            getattr(w, '_accumulative_counts', 1) for w in self._handle.wrappers)
        self._runner = runner
        self._logger = runner.logger
        self._logger.info(
            'mmnanhook: checking %s (policy=%r, anomaly=%r)' %
            (', '.join(type(w).__name__ for w in self._handle.wrappers),
             self.options['policy'], self.anomaly))

    def after_train(self, runner):
        self._restore()

    def _patch(self, obj, name, func):
        # Instance attributes only: the class (shared with other runners and
        # models) is never touched.
        own = vars(obj)
        self._patches.append((obj, name, name in own, own.get(name)))
        setattr(obj, name, func)

    def _restore(self):
        while self._patches:
            obj, name, had, old = self._patches.pop()
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._parsed = None
        self._steps.clear()
        self._buffers = []

    # -- per iteration -----------------------------------------------------

    def _anomaly_enabled(self):
        if self.anomaly == 'always':
            return True
        if _is_count(self.anomaly):
            return self._train_iters < self.anomaly
        return False

    def _before_step(self, runner, data_batch):
        """Keep what a trigger in this train iteration needs to replay it.

        Args:
            runner (Runner): The runner.
            data_batch: The batch as the dataloader produced it (kept by
                reference: ``train_step`` does not mutate it).
        """
        self._steps[runner.iter] = (data_batch, capture_rng())
        while len(self._steps) > self._max_steps:
            self._steps.popitem(last=False)
        if (self.options['policy'] == 'skip'
                and runner.iter % self._max_steps == 0):
            # A skipped step must also undo what the forward wrote into
            # buffers (BN running statistics): only 'skip' pays for the copy.
            model = runner.model
            module = model.module if is_model_wrapper(model) else model
            self._buffers = [(b, b.detach().clone())
                             for b in module.buffers()]

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        # Host floats RuntimeInfoHook already synced: no extra sync here.
        self._history.append(runner.iter, **self._logged_scalars(runner))

    @staticmethod
    def _logged_scalars(runner):
        scalars = runner.message_hub.log_scalars
        values = {}
        for field in ('loss', 'grad_norm', 'lr', 'loss_scale'):
            buffer = scalars.get('train/' + field)
            values[field] = None if buffer is None else buffer.current()
        return values

    def _wrap_train_step(self, runner, train_step):

        @functools.wraps(train_step)
        def nan_detect_train_step(*args, **kwargs):
            state = compat.anomaly_state()
            wanted = self._anomaly_enabled()
            if wanted != state[0]:
                compat.set_detect_anomaly(wanted)
            try:
                self._before_step(runner,
                                  args[0] if args else kwargs.get('data'))
                return train_step(*args, **kwargs)
            except BaseException:
                # The loop ends here: nothing calls after_train.
                self._restore()
                raise
            finally:
                if torch.is_anomaly_enabled() != state[0]:
                    compat.restore_anomaly(state)
                self._train_iters += 1

        return nan_detect_train_step

    def _wrap_parse_losses(self, parse_losses):

        @functools.wraps(parse_losses)
        def nan_detect_parse_losses(*args, **kwargs):
            loss, log_vars = parse_losses(*args, **kwargs)
            self._parsed = (loss, checks.loss_terms(log_vars))
            return loss, log_vars

        return nan_detect_parse_losses

    # -- listener interface of the optim wrapper ---------------------------

    def loss_terms(self, loss):
        """The loss terms ``parse_losses`` produced for ``loss``, if it did.

        Args:
            loss (torch.Tensor): The loss handed to ``update_params``.

        Returns:
            dict | None: name -> detached tensor.
        """
        parsed, self._parsed = self._parsed, None
        if parsed is None or parsed[0] is not loss:
            return None
        return parsed[1]

    def on_nonfinite(self, event):
        """Called by the optim wrapper on a trigger, before the policy acts.

        Args:
            event (NonFiniteEvent): What was non-finite.

        Returns:
            dict | None: ``bundle`` / ``summary`` / ``report`` to add to the
            error.
        """
        message = event.message
        if event.forward_traceback:
            message += ('\nForward call that caused it (anomaly mode):\n' +
                        event.forward_traceback)
        quiet = event.trigger != 'exception' and self.options['policy'] in (
            'skip', 'warn')
        self._logger.log(logging.WARNING if quiet else logging.ERROR,
                         'mmnanhook: ' + message)
        if self.options['policy'] == 'skip' and event.trigger != 'exception':
            self._restore_buffers()
        if event.bad_ranks and event.rank not in event.bad_ranks:
            # The culprit rank(s) replay their own batch and write the bundle.
            return None
        if not self.replay and not self.max_dumps:
            return None
        fail_iter = (event.bad_loss_iters or [event.iter])[0]
        data_batch, rng_state = self._steps.get(fail_iter, (None, None))
        if data_batch is None:
            self._logger.error('mmnanhook: no batch kept for iteration %s: '
                               'no replay and no bundle' % (fail_iter, ))
            return None
        runner = self._runner
        history = self._history.records()
        history.append(dict(self._logged_scalars(runner), iter=runner.iter,
                            loss=event.losses.get('loss'),
                            grad_norm=event.grad_norm,
                            loss_scale=event.loss_scale))
        result = handle_incident(
            runner, event, data_batch, rng_state, history,
            dump_dir=self.dump_dir or default_dump_dir(runner),
            max_dumps=self.max_dumps, replay=self.replay,
            dump_optimizer=self.dump_optimizer,
            anomaly=self.anomaly != 'never')
        self._logger.info('mmnanhook: diagnosis and bundle took %.2f s' %
                          result['seconds'])
        return result

    def _restore_buffers(self):
        with torch.no_grad():
            for buffer, saved in self._buffers:
                buffer.copy_(saved)
