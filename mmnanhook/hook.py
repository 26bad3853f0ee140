"""``NanDetectHook``: the MMEngine entry point of mmnanhook.

``default_hooks = dict(nan_detect=dict(type='mmnanhook.NanDetectHook'))`` is
all a config needs. In ``before_train`` the hook binds the checks of
:mod:`mmnanhook.sentinel` onto the optim wrapper the runner built (after the
param schedulers wrapped its ``step``) and wraps the model's ``train_step``
(anomaly mode around exactly the train iteration, the bypass guard around
the update) and ``parse_losses`` (so a trigger can name the loss term); all
of it is undone in ``after_train`` or when a train step raises.
"""
import contextlib
import functools
import logging

import torch
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from . import compat
from ._mmengine import is_ddp, unwrap_model
from ._patch import set_attribute
from .errors import CheckBypassedError, NonFiniteError
from .diagnosis import (communicating_modules, default_dump_dir,
                        evidence_before, handle_incident, largest_param,
                        local_replays, locate_micro_step)
from .options import (CheckOptions, QuarantineOptions, RewindOptions,
                      anomaly_wanted, check_anomaly, check_bool, check_count,
                      check_path)
from .quarantine import start_quarantine
from .quarantine._inflight import call_with
from .records import Trigger
from .report import forget_nonfinite, to_visualizer
from .sentinel import (BufferSnapshot, BypassGuard, Dropper, Exchange,
                       History, Listener, Rewinder, StepMemory,
                       data_culprits, forward_failed, plan_drop,
                       install_nan_detect, loss_terms, param_norms,
                       rank_finding, start_distributed, step_record)


@HOOKS.register_module()
class NanDetectHook(Hook, Listener):
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
                 dump_optimizer=True,
                 spike_policy='warn',
                 spike_window=50,
                 spike_warmup=20,
                 spike_factor=None,
                 snapshot_interval=50,
                 snapshot_device='cpu',
                 max_snapshots=2,
                 lr_factor=0.1,
                 cooldown=100,
                 max_rewinds=3,
                 quarantine=None,
                 quarantine_file=None,
                 quarantine_skips=False):
        check_anomaly(anomaly)
        self.check_options = CheckOptions(policy, max_skips, min_loss_scale,
                                          max_overflow_skips, spike_policy,
                                          spike_window, spike_warmup,
                                          spike_factor)
        self.rewind_options = RewindOptions(snapshot_interval,
                                            snapshot_device, max_snapshots,
                                            lr_factor, cooldown, max_rewinds)
        check_path('dump_dir', dump_dir)
        check_count('max_dumps', max_dumps, 0)
        check_bool('replay', replay)
        check_count('history', history, 0)
        check_bool('dump_optimizer', dump_optimizer)
        self.quarantine_options = QuarantineOptions(
            quarantine, quarantine_file, quarantine_skips)
        self.anomaly = anomaly
        self.dump_dir = dump_dir
        self.max_dumps = max_dumps
        self.replay = replay
        self.history = history
        self.dump_optimizer = dump_optimizer
        self._handle = None
        self._guard = None
        self._verified = False
        self._patches = []
        self._parsed = None
        self._train_iters = 0
        self._memory = StepMemory()
        self._history = History(maxlen=history)
        self._buffers = None
        self._micro_buffers = None
        self._runner = None
        self._logger = None
        self._rewinder = None
        # What the check of this iteration's update step measured.
        self._step = {}
        self._rewound_at = None
        # Parameter norms when the current run of spikes began.
        self._spike_norms = None
        # The largest |weight| training started from (exploding updates).
        self._start_weight = None
        # policy='drop', and the samples it keeps out of the dataloader.
        self._dropper = None
        self._quarantine = None
        # A distributed run's ranks, the guard of its train steps'
        # collectives, and the model's modules that communicate in their
        # forward.
        self._ranks = None
        self._forward_guard = None
        self._communicating = []

    # -- lifecycle ---------------------------------------------------------

    def before_train(self, runner):
        self._restore()
        opts = self.check_options
        self._handle = install_nan_detect(
            runner.optim_wrapper, listener=self,
            message_hub=runner.message_hub,
            **dict((k, getattr(opts, k)) for k in opts.__slots__))
        self._guard = BypassGuard(self._handle)
        self._ranks, self._forward_guard, self._communicating = \
            start_distributed(unwrap_model(runner.model),
                              communicating_modules)
        for sentinel in self._handle.sentinels:
            sentinel.ranks = self._ranks
        self._verified = False
        self._train_iters = 0
        model = runner.model
        self._patch(model, 'train_step',
                    self._wrap_train_step(runner, model.train_step))
        module = unwrap_model(model)
        self._patch(module, 'parse_losses',
                    self._wrap_parse_losses(module.parse_losses))
        self._memory = StepMemory(max(
            getattr(w, '_accumulative_counts', 1)
            for w in self._handle.wrappers))
        self._runner = runner
        self._logger = runner.logger
        self._step = {}
        self._spike_norms = None
        self._start_weight = (largest_param(module) or {}).get('max_abs')
        self._rewinder = None
        if opts.rewinds:
            self._rewinder = Rewinder(self.rewind_options, self._logger.log)
            self._rewinder.start(module, self._handle.wrappers)
        self._dropper = None
        if opts.policy == 'drop':
            self._dropper = Dropper(model, self._handle.wrappers,
                                    self._logger.log)
        quarantine = self.quarantine_options
        if quarantine.used_by(opts.policy):
            self._quarantine = start_quarantine(
                runner, quarantine.reviewed, quarantine.path,
                writes=self._ranks is None or self._ranks.writes)

    def after_train(self, runner):
        self._restore()

    def _patch(self, obj, name, func):
        # Instance attributes only: the class (shared with other runners and
        # models) is never touched.
        self._patches.append(set_attribute(obj, name, func))

    def _restore(self):
        while self._patches:
            self._patches.pop()()
        for part in (self._handle, self._quarantine, self._forward_guard):
            if part is not None:
                part.remove()
        if self._ranks is not None:
            self._ranks.close()
        self._handle = self._quarantine = self._forward_guard = None
        self._ranks = self._guard = self._parsed = self._dropper = None
        self._memory.clear()
        self._buffers = self._micro_buffers = None
        # Snapshots are memory of the run that ended.
        self._rewinder = None

    # -- per iteration -----------------------------------------------------

    def _before_step(self, runner, data_batch):
        """Keep what a trigger in this train iteration needs to replay it.

        Args:
            runner (Runner): The runner.
            data_batch: The batch as the dataloader produced it (kept by
                reference: ``train_step`` does not mutate it).
        """
        if self.check_options.skips:
            # Before the first micro-step since the last update step (a
            # resumed one's too), and before this one (a forward taken again
            # under accumulation).
            model = unwrap_model(runner.model)
            self._micro_buffers = BufferSnapshot(model) if self._memory \
                else None
            if not self._memory:
                self._buffers = BufferSnapshot(model)
        self._memory.keep(runner.iter, data_batch)
        self._step = {}
        self._rewound_at = None

    def _after_step(self, runner):
        if not self._guard.verify(runner.iter):
            return
        # The update step is done: its batches can no longer be replayed.
        self._memory.clear()
        if self._rewinder is not None:
            clean = not self._step.get('spikes') and not self._step.get(
                'triggered')
            self._rewinder.after_update(
                runner.iter, clean, unwrap_model(runner.model),
                self._handle.wrappers, self._handle.sentinels)
        if self._verified:
            return
        # Said only now that a check has really run for an update step.
        self._verified = True
        self._logger.info(
            'mmnanhook: checking %s (policy=%r, anomaly=%r): the check ran '
            'for the update step of iter %d' %
            (', '.join(type(w).__name__ for w in self._handle.wrappers),
             self.check_options.policy, self.anomaly, runner.iter))

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        # Host floats already synced (ours, RuntimeInfoHook's): no sync here.
        self._history.append(**self._record(runner))
        # A micro-step whose update step will not be applied as it is.
        if self._memory and self.check_options.policy != 'warn':
            forget_nonfinite(runner.message_hub, outputs)

    def _record(self, runner, **values):
        """This iteration's history record; ``values`` override."""
        rewinder = self._rewinder
        return step_record(
            runner.message_hub.log_scalars, self._step,
            rewinder.factor if rewinder is not None and
            rewinder.cooldown_left else None,
            **dict(dict(iter=runner.iter, rewind=self._rewound_at),
                   **values))

    def _wrap_train_step(self, runner, train_step):

        @functools.wraps(train_step)
        def nan_detect_train_step(*args, **kwargs):
            state = compat.anomaly_state()
            wanted = anomaly_wanted(self.anomaly, self._train_iters)
            if wanted != state[0]:
                compat.set_detect_anomaly(wanted)
            records = None
            guard = self._forward_guard
            try:
                if guard is not None:
                    guard.active = True
                if self._quarantine is not None:
                    # Under DDP every rank takes a step: a batch is never
                    # left empty there.
                    args, kwargs = self._quarantine.admit(
                        runner, args, kwargs, empty=self._ranks is None)
                    if args is None:
                        self._step = {}
                        return {}
                self._before_step(runner,
                                  args[0] if args else kwargs.get('data'))
                self._guard.start()
                records = self._records()
                outputs = train_step(*args, **kwargs)
                self._after_step(runner)
                return self._logged(outputs)
            except (NonFiniteError, CheckBypassedError):
                self._restore()
                raise
            except Exception as exc:
                try:
                    # Raised before any backward: the forward failed.
                    handled = records is not None and \
                        self._records() == records and \
                        self._forward_failed(runner, exc, functools.partial(
                            call_with, train_step, args, kwargs))
                    if isinstance(handled, dict):
                        return self._logged(handled)
                except BaseException:
                    self._restore()
                    raise
                self._restore()
                raise
            except BaseException:
                # The loop ends here: nothing calls after_train.
                self._restore()
                raise
            finally:
                if guard is not None:
                    guard.active = False
                if torch.is_anomaly_enabled() != state[0]:
                    compat.restore_anomaly(state)
                self._train_iters += 1

        return nan_detect_train_step

    def _logged(self, outputs):
        """What the train step returns, for RuntimeInfoHook to put in the
        windows LogProcessor smooths: nothing of a step that was not
        applied, the recomputation's values for a dropped one."""
        dropped = self._dropper.take_outputs() if self._dropper else None
        if self._step.get('applied') is False:
            return {}
        return dropped if dropped is not None else outputs

    def _records(self):
        return sum(s.check.records for s in self._handle.sentinels)

    def _forward_failed(self, runner, exc, train_step):
        """A train step whose forward raised (here, or on another rank):
        see :func:`~mmnanhook.sentinel.forward_failed`."""
        micro = self._micro_buffers or self._buffers
        return forward_failed(
            runner, exc, train_step, self, self._ranks, self.replay,
            self._memory.steps, self._handle.sentinels[0],
            getattr(self._buffers, 'restore', None),
            getattr(micro, 'restore', None), self._dropper,
            self._handle.wrappers)

    def _wrap_parse_losses(self, parse_losses):

        @functools.wraps(parse_losses)
        def nan_detect_parse_losses(*args, **kwargs):
            loss, log_vars = parse_losses(*args, **kwargs)
            self._parsed = (loss, loss_terms(log_vars))
            return loss, log_vars

        return nan_detect_parse_losses

    # -- the Listener interface of the optim wrappers' sentinels -----------

    def loss_terms(self, loss):
        parsed, self._parsed = self._parsed, None
        if parsed is None or parsed[0] is not loss:
            return None
        return parsed[1]

    def on_step(self, outcome):
        self._step.update(loss=outcome.loss, grad_norm=outcome.grad_norm,
                          loss_scale=outcome.loss_scale)

    def on_resolved(self, applied):
        self._step['applied'] = applied
        found = self._dropper.take_found() if self._dropper else None
        if applied and found:
            self._quarantine.record(found, self._step['event'], 'drop',
                                    self._logger)

    def on_spike(self, spikes):
        for spike in spikes:
            self._logger.warning('mmnanhook: %r' % (spike, ))
        self._step['spikes'] = [spike.series for spike in spikes]
        detector = self._detector()
        earlier = [s for s in detector.spikes[:-len(spikes)]
                   if s.iter >= spikes[0].iter -
                   self.check_options.spike_window]
        if not earlier:
            # The first spike of a run: the norms it is measured from.
            self._spike_norms = param_norms(unwrap_model(self._runner.model))

    def _detector(self):
        return self._handle.sentinels[0].check.spikes

    def on_nonfinite(self, event):
        message = event.message
        if event.forward_traceback:
            message += ('\nForward call that caused it (anomaly mode):\n' +
                        event.forward_traceback)
        opts = self.check_options
        spike = event.trigger == Trigger.SPIKE
        policy = opts.spike_policy if spike else opts.policy
        exception = event.trigger == Trigger.EXCEPTION
        quiet = not exception and policy in ('skip', 'warn', 'rewind',
                                             'drop')
        self._logger.log(logging.WARNING if quiet else logging.ERROR,
                         'mmnanhook: ' + message)
        if not spike:
            self._step['triggered'] = True
        if policy in ('skip', 'rewind', 'drop') and not exception:
            self._buffers.restore()
        evidence = self._divergence(event)
        rewind = policy == 'rewind' and not exception and (
            evidence is not None or self._weights_broken())
        # Under DDP every rank has this event: one decision, and they
        # exchange what they find.
        ranks = self._ranks if event.shared else None
        if ranks is not None and policy == 'rewind' and not exception:
            rewind = bool(ranks.reduce(rewind, 'max'))
        result = {}
        exchange = Exchange(ranks) if ranks is not None else None
        try:
            if (not spike or rewind or policy == 'raise') and (
                    not event.bad_ranks or event.rank in event.bad_ranks):
                # The culprit rank(s) replay their own batch and write the
                # bundle; a spike only when it stops or rewinds training.
                result = self._incident(
                    event, evidence,
                    logging.WARNING if quiet else logging.ERROR,
                    self.rewind_options if rewind else None, exchange) or {}
        except Exception:  # noqa: BLE001 - the policy applies, on every rank
            if ranks is None:
                raise
            self._logger.exception('mmnanhook: the diagnosis failed')
        finally:
            if exchange is not None:
                # Once on every rank, whatever the diagnosis did; a rank
                # whose forward raised and said nothing stops them all.
                result['findings'] = exchange(rank_finding(
                    event.rank, iter=event.fail_iter, raises=exception and
                    event.rank in event.bad_ranks))
        if not spike:
            self._recover(event, policy, result)
        if rewind:
            snapshot, reason = self._rewinder.rewind(
                evidence['began_at'] if evidence else event.iter,
                unwrap_model(self._runner.model), self._handle.wrappers,
                self._handle.sentinels, ranks)
            if reason:
                result['escalate'] = reason
            else:
                self._rewound_at = snapshot.iter
        return result or None

    def _recover(self, event, policy, result):
        """What ``'drop'`` (or ``quarantine_skips``) does with the samples
        the diagnosis, or every rank's (DDP), singled out."""
        findings = result.get('findings')
        report = result.get('report') or {}
        data, samples = (report.get('kind') == 'data',
                         report.get('samples') or []) if findings is None \
            else data_culprits(event, findings)
        if policy == 'drop' and (event.trigger != Trigger.EXCEPTION or data):
            self._step['event'] = event
            steps, undo = self._memory.steps(), self._buffers.restore
            result['drop'] = self._dropper.plan(
                event, result.get('report'), steps, undo) \
                if findings is None else plan_drop(
                    self._dropper, event, steps, undo, findings, self._ranks,
                    self._forward_guard.communicates(self._communicating),
                    is_ddp(self._runner.model), self._logger)
        elif (self.quarantine_options.skips and policy in ('skip', 'rewind')
              and data):
            self._quarantine.record(samples, event, policy, self._logger)

    def _weights_broken(self):
        # Failure path: a sync per parameter is fine here.
        return any(not bool(torch.isfinite(p).all())
                   for p in unwrap_model(self._runner.model).parameters())

    def _divergence(self, event):
        """Evidence of a divergence before ``event``, or ``None``."""
        rewinder = self._rewinder
        return evidence_before(
            event, self._history.records() + [self._event_record(event)],
            self._detector(), self.check_options.spike_window,
            self._spike_norms,
            rewinder.store if rewinder is not None else None,
            lambda: param_norms(unwrap_model(self._runner.model)))

    def _event_record(self, event):
        return self._record(self._runner, loss=event.losses.get('loss'),
                            grad_norm=event.grad_norm,
                            loss_scale=event.loss_scale)

    def _incident(self, event, evidence, level, rewind, exchange=None):
        """Diagnose ``event`` and write its bundle; the answer for the error.

        Under DDP the replays run on this rank alone (modules that
        communicate in their forward made local), and ``exchange`` gathers
        every rank's finding before the bundle is written.
        """
        if not self.replay and not self.max_dumps:
            return None
        model = unwrap_model(self._runner.model)
        replays = functools.partial(local_replays, self._communicating) \
            if self._ranks is not None else contextlib.nullcontext
        with replays():
            fail_iter = locate_micro_step(
                event, model, self._memory.steps() if self.replay else [])
        data_batch, rng_state = self._memory.get(fail_iter)
        if data_batch is None:
            self._logger.error('mmnanhook: no batch kept for iteration %s: '
                               'no replay and no bundle' % (fail_iter, ))
            return None
        runner = self._runner
        history = self._history.records() + [self._event_record(event)]
        result = handle_incident(
            runner, event, data_batch, rng_state, history,
            dump_dir=self.dump_dir or default_dump_dir(runner),
            max_dumps=self.max_dumps, replay=self.replay,
            dump_optimizer=self.dump_optimizer,
            anomaly=self.anomaly != 'never', divergence=evidence,
            start_weight=self._start_weight, level=level, rewind=rewind,
            replays=replays, exchange=exchange)
        to_visualizer(getattr(runner, 'visualizer', None), result,
                      event.iter, self._logger)
        # What the diagnosis allocated is free now: give it back.
        compat.trim_heap()
        self._logger.info('mmnanhook: diagnosis and bundle took %.2f s' %
                          result['seconds'])
        return result
