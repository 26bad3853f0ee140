"""``NanDetectHook``: the MMEngine entry point of mmnanhook.

``default_hooks = dict(nan_detect=dict(type='mmnanhook.NanDetectHook'))`` is
all a config needs. The hook is a thin adapter over MMEngine's lifecycle: in
``before_train`` it makes the run's :class:`~mmnanhook.run.HookRun`, which
binds the checks of :mod:`mmnanhook.sentinel` onto the optim wrapper the
runner built (after the param schedulers wrapped its ``step``) and wraps the
model's ``train_step`` (anomaly mode around exactly the train iteration, the
bypass guard around the update) and ``parse_losses`` (so a trigger can name
the loss term); the run undoes all of it in ``after_train`` or when a train
step raises. The sentinels talk to the run; nothing passes through here.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from . import compat
from ._patch import set_attribute
from .doctor import check_run_config
from .memory import History
from .options import HookOptions
from .quarantine import read_quarantine
from .run import HookRun


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
            ``'warn'`` log and step as MMEngine would have; ``'rewind'``
            go back to the last good snapshot before the divergence (or skip,
            when nothing diverged: a single bad batch) and lower the LR for
            a while; ``'drop'`` recompute the step without the samples the
            diagnosis singles out, apply it and quarantine them (or skip,
            saying why, when none can be singled out).
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
        dump_state (str): Which bundles hold the model (and optimizer)
            state, the bulk of a bundle: ``'per_kind'`` (default) the first
            bundle of each kind of incident in the run, written by one rank
            (the culprit's); every other bundle holds its batch, report, RNG
            and pictures and names that bundle, which its replay loads the
            state from (docs/bundles.md). ``'every'``: each bundle holds
            its own.
        doctor (str, optional): The config rules of ``mmnan doctor`` run on
            the run's config at ``before_train``: ``'warn'`` (default: one
            log line per finding; a later trigger's report names the one
            that explains it), ``'raise'`` (training does not start while
            any is found) or ``None`` (not run).
        spike_policy (str, optional): What a finite spike of the loss or
            the gradient norm does: ``None`` (not detected), ``'warn'``
            (default: logged, counted in ``train/spikes``, marked in the
            history), ``'skip'``, ``'rewind'`` or ``'raise'``.
        spike_window (int): Iterations the spike band (median and MAD) is
            computed over. Defaults to 50.
        spike_warmup (int): Iterations seen before any is judged. Defaults
            to 20.
        spike_factor (float | dict): A spike is at least this many times
            the band's median (and 6 robust standard deviations above it):
            one number, or ``dict(loss=..., grad_norm=...)``. Defaults to
            4 for the loss and 20 for the gradient norm, whose clean
            batch-to-batch spread is wider.
        snapshot_interval (int): Under ``'rewind'``, iterations between
            snapshots of a good state. Defaults to 50.
        snapshot_device (str): Where snapshots live. Defaults to ``'cpu'``.
        max_snapshots (int): Snapshots kept. Defaults to 2.
        lr_factor (float): After a rewind the LR of every param group is
            multiplied by this (again after each consecutive rewind) for
            ``cooldown`` update steps; the schedulers keep running.
            Defaults to 0.1.
        cooldown (int): Update steps the LR stays lowered. Defaults to 100.
        max_rewinds (int): Consecutive rewinds without ``cooldown`` clean
            update steps in between, after which training stops. Defaults
            to 3.
        quarantine (str, optional): A quarantine list (``mmnan scan
            --quarantine``, or a run's ``nan_quarantine.json``) a user
            reviewed: those samples are never loaded in this run.
        quarantine_file (str, optional): Where the run's quarantine list is
            written; defaults to ``{work_dir}/nan_quarantine.json``, which a
            resumed run (``resume=True``) reads back.
        quarantine_skips (bool): Under ``'skip'`` and ``'rewind'``, also
            quarantine the samples a diagnosis names. ``'drop'`` always
            quarantines what it dropped. Defaults to False: those policies
            promise to leave one step out, not to change what the
            dataloader yields.

    Raises:
        ValueError: For a bad option, naming it.
        TypeError: For an option that does not exist, naming it.

    Example:
        >>> custom_imports = dict(imports=['mmnanhook'],
        ...                       allow_failed_imports=False)
        >>> custom_hooks = [dict(type='NanDetectHook', policy='skip')]
    """

    priority = 'ABOVE_NORMAL'

    def __init__(self, **options: Any) -> None:
        self.options = HookOptions.build(**options)
        if self.options.quarantine.quarantine is not None:
            # A file that is not a quarantine list fails at build time.
            read_quarantine(self.options.quarantine.quarantine)
        # Kept across runs: a bundle's history, and what a user reads after.
        self._history = History(maxlen=self.options.history)
        # The run's state, from before_train until the run ends, and how to
        # put the model's train_step back.
        self._run: Optional[HookRun] = None
        self._restore = None

    # -- lifecycle ---------------------------------------------------------

    def before_train(self, runner: Any) -> None:
        self._end_run()
        findings = check_run_config(runner, self.options.doctor)
        self._run = HookRun(self.options, runner, self._history, findings)
        # Instance attribute only: the class (shared with other runners and
        # models) is never touched.
        self._restore = set_attribute(
            runner.model, 'train_step',
            self._wrap_train_step(runner.model.train_step))

    def after_train(self, runner: Any) -> None:
        self._end_run('finished')

    def before_val(self, runner: Any) -> None:
        # Before any hook's before_val_epoch: EMAHook swaps the weights in
        # place there.
        if self._run is not None:
            self._run.settle()

    def after_train_iter(self, runner: Any, batch_idx: int,
                         data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        if self._run is not None:
            self._run.after_iter(outputs)

    def _end_run(self, how=None):
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()
        run, self._run = self._run, None
        if run is not None:
            run.close(how)

    def _wrap_train_step(self, train_step):

        @functools.wraps(train_step)
        def nan_detect_train_step(*args, **kwargs):
            try:
                return self._run.train_step(train_step, args, kwargs)
            except BaseException as error:
                # The loop ends here: nothing calls after_train.
                self._end_run('%s: %s' % (type(error).__name__, str(
                    error).strip().split('\n', 1)[0]))
                raise

        # Runner._maybe_compile compiled train_step before this wraps it:
        # the compiled step runs inside; this stays out of any graph should
        # something compile the model's train_step later.
        return compat.not_traced(nan_detect_train_step)
