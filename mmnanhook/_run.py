"""One training run under ``NanDetectHook``: what it keeps, and its answer.

:class:`HookRun` is made in ``before_train`` and dropped when the run ends
(or a train step raises): the checks installed on the optim wrappers, what a
trigger needs to replay its iteration (batches, RNG states, buffers, the
history), the snapshots of ``'rewind'``, the drops and the quarantine. On a
trigger it asks :class:`~mmnanhook.recovery.Policy` what to undo, diagnose,
rewind, drop and quarantine, does it, and answers the sentinel with a typed
:class:`~mmnanhook.recovery.Answer`, with which the sentinel decides.

Over 500 lines because it is the one place where the rooms meet for a run:
each part it holds is built in its room, and what stays here is the wiring
and the order of a trigger's steps, which one reading should show whole.
"""
import contextlib
import ctypes
import functools
import traceback

import torch

from . import compat
from ._mmengine import is_ddp, unwrap_model
from .bundle import StateLedger
from .diagnosis import (communicating_modules, evidence_before,
                        handle_incident, largest_param, local_replays,
                        locate_micro_step, preserved_run)
from .errors import (CheckBypassedError, NonFiniteError, PeerForwardFailed,
                     RankTimeoutError)
from .options import anomaly_wanted
from .quarantine import call_with, prepare_index, start_quarantine
from .records import Culprit, Trigger
from .recovery import (Action, Answer, Policy, data_culprits, rank_finding)
from .report import forget_nonfinite, to_visualizer
from .sentinel import (BufferSnapshot, BypassGuard, Dropper, Exchange,
                       ForwardStart, Rewinder, StepMemory, StepState,
                       forward_event, install_nan_detect, is_out_of_memory,
                       param_norms, plan_drop, start_distributed, step_record)


class HookRun(object):
    """The state of one run, and what it does on a trigger.

    Args:
        options (HookOptions): The hook's options.
        runner (Runner): The runner.
        listener (Listener): What the sentinels tell (the hook, which hands
            it on to this run).
        history (History): Where each iteration's scalars go (the hook's:
            it outlives the run).
        config_findings (list[ConfigFinding]): What the config rules found
            in the run's config; a trigger's report names those that
            explain it.
    """

    def __init__(self, options, runner, listener, history,
                 config_findings=()):
        self.options = options
        self.config_findings = list(config_findings)
        self.policy = Policy(options.check)
        self.runner = runner
        self.logger = runner.logger
        self.listener = listener
        self.handle = install_nan_detect(
            runner.optim_wrapper, listener=listener,
            message_hub=runner.message_hub, options=options.check)
        self.guard = BypassGuard(self.handle)
        module = unwrap_model(runner.model)
        # A distributed run's ranks, the guard of its train steps'
        # collectives, and the model's modules that communicate in their
        # forward.
        self.ranks, self.forward_guard, self.communicating = \
            start_distributed(module, communicating_modules, runner.cfg)
        if self.forward_guard is not None and is_ddp(runner.model):
            # DDP's broadcasts from C++ at the start of its forward.
            self.forward_guard.watch(runner.model)
        for sentinel in self.handle.sentinels:
            sentinel.ranks = self.ranks
        self.verified = False
        self.train_iters = 0
        self.memory = StepMemory(max(
            getattr(w, '_accumulative_counts', 1)
            for w in self.handle.wrappers),
            getattr(module, 'data_preprocessor', None))
        self.history = history
        # Buffers before the update step's first micro-step, and before the
        # current one (accumulation).
        self.buffers = self.micro_buffers = None
        # (loss, its terms) of the last parse_losses.
        self.parsed = None
        self.step = StepState()
        self.rewound_at = None
        # Which of the run's bundles hold a model state.
        self.states = StateLedger(getattr(runner, 'timestamp', None),
                                  every=options.dump_state == 'every')
        # Parameter norms when the current run of spikes began.
        self.spike_norms = None
        # The largest |weight| training started from (exploding updates).
        self.start_weight = (largest_param(module) or {}).get('max_abs')
        # The diagnosis and the quarantine look samples up by file: a large
        # dataset's index is walked in a child process from now on (forked
        # before the snapshot thread below starts).
        prepare_index(runner.train_dataloader.dataset)
        self.rewinder = None
        if self.policy.rewinds:
            self.rewinder = Rewinder(options.rewind, self.logger.log)
            # Under DDP every rank holds the same parameters: each keeps
            # its share of the snapshots.
            self.rewinder.start(module, self.handle.wrappers,
                                self.ranks if is_ddp(runner.model) else None)
        self.dropper = None
        if self.policy.drops_at_all():
            self.dropper = Dropper(runner.model, self.handle.wrappers,
                                   self.logger.log)
        quarantine = options.quarantine
        self.quarantine = None
        if (self.dropper is not None or quarantine.quarantine_skips
                or quarantine.quarantine is not None):
            self.quarantine = start_quarantine(
                runner, quarantine.quarantine, quarantine.quarantine_file,
                writes=self.ranks is None or self.ranks.writes)

    def close(self):
        """Undo every change and let go of what the run kept."""
        for part in (self.handle, self.quarantine, self.forward_guard):
            if part is not None:
                part.remove()
        if self.ranks is not None:
            self.ranks.close()
        self.memory.clear()
        self.buffers = self.micro_buffers = self.parsed = None
        self.settle()
        # Snapshots are memory of the run that ended.
        self.rewinder = self.dropper = None

    @property
    def sentinel(self):
        """The sentinel of the (first) optim wrapper."""
        return self.handle.sentinels[0]

    # -- per train step ----------------------------------------------------

    def train_step(self, train_step, args, kwargs):
        """The model's ``train_step`` under the checks; raises what it does
        not handle (the hook then ends the run's changes)."""
        state = compat.anomaly_state()
        wanted = anomaly_wanted(self.options.anomaly, self.train_iters)
        if wanted != state[0]:
            compat.set_detect_anomaly(wanted)
        records = None
        guard = self.forward_guard
        try:
            if guard is not None:
                guard.begin(self._records)
            if self.quarantine is not None:
                # Under DDP every rank takes a step: a batch is never left
                # empty there.
                args, kwargs = self.quarantine.admit(
                    self.runner, args, kwargs, empty=self.ranks is None)
                if args is None:
                    self.step = StepState()
                    return {}
            self._before_step(args[0] if args else kwargs.get('data'))
            self.guard.start()
            records = self._records()
            outputs = train_step(*args, **kwargs)
            self._after_step()
            return self._logged(outputs)
        except (NonFiniteError, CheckBypassedError, RankTimeoutError):
            raise
        except Exception as exc:
            # Raised before any backward: the forward failed.
            handled = None
            if records is not None and self._records() == records:
                # Taken again on another batch: eagerly, as every replay,
                # not through a compiled train_step (a new batch size would
                # recompile it).
                eager = compat.compiled_original(train_step) or train_step
                handled = self.forward_failed(exc, functools.partial(
                    call_with, eager, args, kwargs))
            if handled is None:
                raise
            return self._logged(handled)
        finally:
            if guard is not None:
                guard.end()
            if torch.is_anomaly_enabled() != state[0]:
                compat.restore_anomaly(state)
            self.train_iters += 1

    def _before_step(self, data_batch):
        """Keep what a trigger in this train iteration needs to replay it:
        the batch (by reference: ``train_step`` does not mutate it), its
        RNG states and, when a step may be left out, the buffers."""
        attributes = self.memory.preprocessor_attributes()
        if self.policy.leaves_steps_out:
            # Before the first micro-step since the last update step (a
            # resumed one's too), and before this one (a forward taken again
            # under accumulation).
            model = unwrap_model(self.runner.model)
            self.micro_buffers = ForwardStart(
                BufferSnapshot(model), attributes) if self.memory else None
            if not self.memory:
                self.buffers = ForwardStart(BufferSnapshot(model), attributes)
        self.memory.keep(self.runner.iter, data_batch, attributes)
        self.step = StepState()
        self.rewound_at = None

    def _after_step(self):
        runner = self.runner
        if not self.guard.verify(runner.iter):
            return
        # The update step is done: its batches can no longer be replayed.
        self.memory.clear()
        if self.rewinder is not None:
            clean = not self.step.spikes and not self.step.triggered
            self.rewinder.after_update(
                runner.iter, clean, unwrap_model(runner.model),
                self.handle.wrappers, self.handle.sentinels)
        if self.verified:
            return
        # Said only now that a check has really run for an update step.
        self.verified = True
        self.logger.info(
            'mmnanhook: checking %s (policy=%r, anomaly=%r): the check ran '
            'for the update step of iter %d' %
            (', '.join(type(w).__name__ for w in self.handle.wrappers),
             self.options.check.policy, self.options.anomaly, runner.iter))

    def after_iter(self, outputs):
        """Keep the iteration's history; forget the non-finite scalars of a
        micro-step whose update step will not be applied as it is.
        (Host floats already synced, ours and RuntimeInfoHook's: no sync.)
        """
        self.history.append(**self._record())
        if self.memory and not self.policy.warns_only:
            forget_nonfinite(self.runner.message_hub, outputs)

    def _record(self, **values):
        """This iteration's history record; ``values`` override."""
        rewinder = self.rewinder
        return step_record(
            self.runner.message_hub.log_scalars, self.step,
            rewinder.factor if rewinder is not None and
            rewinder.cooldown_left else None,
            **dict(dict(iter=self.runner.iter, rewind=self.rewound_at),
                   **values))

    def _logged(self, outputs):
        """What the train step returns, for RuntimeInfoHook to put in the
        windows LogProcessor smooths: nothing of a step that was not
        applied, the recomputation's values for a dropped one."""
        dropped = self.dropper.take_outputs() if self.dropper else None
        if self.step.applied is False:
            return {}
        return dropped if dropped is not None else outputs

    def _records(self):
        return sum(s.check.records for s in self.handle.sentinels)

    def parsed_losses(self, loss, terms):
        """Note what ``parse_losses`` made (the loss and its terms)."""
        self.parsed = (loss, terms)

    # -- what the sentinels tell -------------------------------------------

    def loss_terms(self, loss):
        parsed, self.parsed = self.parsed, None
        if parsed is None or parsed[0] is not loss:
            return None
        return parsed[1]

    def settle(self):
        """Wait for the newest snapshot's copy: before anything changes
        the parameters or optimizer state it copies (an update step; EMA's
        swap of the weights for validation)."""
        if self.rewinder is not None:
            self.rewinder.store.settle()

    def on_step(self, outcome):
        self.settle()
        self.step.loss = outcome.loss
        self.step.grad_norm = outcome.grad_norm
        self.step.loss_scale = outcome.loss_scale

    def on_resolved(self, applied):
        self.step.applied = applied
        found = self.dropper.take_found() if self.dropper else None
        if applied and found:
            self.quarantine.record(found, self.step.event, 'drop',
                                   self.logger)

    def on_spike(self, spikes):
        for spike in spikes:
            self.logger.warning('mmnanhook: %r' % (spike, ))
        self.step.spikes = [spike.series for spike in spikes]
        earlier = [s for s in self._detector().spikes[:-len(spikes)]
                   if s.iter >= spikes[0].iter -
                   self.options.check.spike_window]
        if not earlier:
            # The first spike of a run: the norms it is measured from.
            self.spike_norms = param_norms(unwrap_model(self.runner.model))

    def _detector(self):
        return self.sentinel.check.spikes

    def on_nonfinite(self, event):
        """Undo, diagnose, exchange, rewind and prepare a drop, as the
        policy says; the :class:`~mmnanhook.recovery.Answer`."""
        policy = self.policy
        message = event.message
        if event.forward_traceback:
            message += ('\nForward call that caused it (anomaly mode):\n' +
                        event.forward_traceback)
        level = policy.level(event)
        self.logger.log(level, 'mmnanhook: ' + message)
        if event.trigger != Trigger.SPIKE:
            self.step.triggered = True
        if policy.undoes_forward(event):
            self.buffers.restore()
        evidence = self._divergence(event)
        rewind = policy.may_rewind(event) and (
            evidence is not None or self._weights_broken())
        # Under DDP every rank has this event: one decision, and they
        # exchange what they find.
        ranks = self.ranks if event.shared else None
        if ranks is not None and policy.may_rewind(event):
            rewind = bool(ranks.reduce(rewind, 'max'))
        incident, findings = None, None
        exchange = Exchange(ranks) if ranks is not None else None
        diagnosers = policy.diagnosers(event, rewind)
        if ranks is None:
            # Alone, or a trigger only this rank saw.
            diagnosers = [r for r in diagnosers if r == event.rank]
        try:
            if event.rank in diagnosers:
                # The culprit rank(s) replay their own batch and write the
                # bundle.
                event, incident = self._incident(event, evidence, level,
                                                 rewind, exchange, diagnosers)
        except Exception:  # noqa: BLE001 - the policy applies, on every rank
            if ranks is None:
                raise
            self.logger.exception('mmnanhook: the diagnosis failed')
        finally:
            if exchange is not None:
                # Once on every rank, whatever the diagnosis did; a rank
                # whose forward raised and said nothing stops them all.
                raises = (event.trigger == Trigger.EXCEPTION
                          and event.rank in event.bad_ranks)
                findings = tuple(exchange(rank_finding(
                    event.rank, iter=event.fail_iter, raises=raises,
                    error=event.exception)))
        report = incident.report if incident is not None else None
        # Under DDP every rank records what the writer wrote (it cannot
        # know); alone, only a bundle written holds a state to name.
        if diagnosers and self.options.max_dumps and (
                findings is not None or incident is not None
                and incident.bundle is not None):
            self.states.record(
                event, event.iter if event.iter is not None else
                self.runner.iter, findings,
                report.kind if report is not None else None, diagnosers)
        drop = self._recover(event, report, findings)
        escalate = self._rewind(event, evidence, ranks) if rewind else None
        return Answer(bundle=incident.bundle if incident else None,
                      report=report, drop=drop, escalate=escalate,
                      findings=findings)

    def _recover(self, event, report, findings):
        """The drop plan of a trigger (``'drop'``), or the quarantine of
        its samples (``quarantine_skips``), from the diagnosis or every
        rank's (DDP) findings."""
        if findings is None:
            data = report is not None and report.kind == 'data'
            samples = [Culprit(s) for s in report.samples] if data else []
        else:
            data, samples = data_culprits(event, findings)
        if self.policy.drops(event, data):
            self.step.event = event
            steps, undo = self.memory.steps(), self.buffers.restore
            if findings is None:
                return self.dropper.plan(event, report, steps, undo)
            return plan_drop(
                self.dropper, event, steps, undo, findings, self.ranks,
                self.forward_guard.communicates(self.communicating),
                is_ddp(self.runner.model), self.logger)
        if self.policy.quarantines(event, data,
                                   self.options.quarantine.quarantine_skips):
            self.quarantine.record(samples, event, self.policy.of(event),
                                   self.logger)
        return None

    def _rewind(self, event, evidence, ranks):
        """Go back to the snapshot before the divergence; why training
        must stop instead, or ``None``."""
        snapshot, reason = self.rewinder.rewind(
            evidence['began_at'] if evidence else event.iter,
            unwrap_model(self.runner.model), self.handle.wrappers,
            self.handle.sentinels, ranks)
        if not reason:
            self.rewound_at = snapshot.iter
        return reason

    def _weights_broken(self):
        # Failure path: a sync per parameter is fine here.
        return any(not bool(torch.isfinite(p).all())
                   for p in unwrap_model(self.runner.model).parameters())

    def _divergence(self, event):
        """Evidence of a divergence before ``event``, or ``None``."""
        rewinder = self.rewinder
        return evidence_before(
            event, self.history.records() + [self._event_record(event)],
            self._detector(), self.options.check.spike_window,
            self.spike_norms,
            rewinder.store if rewinder is not None else None,
            lambda: param_norms(unwrap_model(self.runner.model)))

    def _event_record(self, event):
        return self._record(loss=event.losses.get('loss'),
                            grad_norm=event.grad_norm,
                            loss_scale=event.loss_scale)

    def _incident(self, event, evidence, level, rewind, exchange=None,
                  diagnosers=()):
        """Diagnose ``event`` and write its bundle.

        Returns:
            tuple: ``event`` with its failing micro-step found, and the
            :class:`~mmnanhook.diagnosis.Incident` (``None`` when nothing
            was diagnosed).

        Under DDP the replays run on this rank alone (modules that
        communicate in their forward made local), and ``exchange`` gathers
        every rank's finding before the bundle is written.
        """
        options = self.options
        if not options.replay and not options.max_dumps:
            return event, None
        runner = self.runner
        model = unwrap_model(runner.model)
        replays = functools.partial(
            local_replays, self.communicating,
            self.forward_guard.step_collectives()) \
            if self.ranks is not None else contextlib.nullcontext
        # A replay leaves no trace: what it sets outside tensors (the
        # preprocessor's next input size, a head's last assignment, the
        # MessageHub's runtime info) is put back as the run had it.
        with preserved_run(runner, model):
            with replays():
                event = locate_micro_step(
                    event, model,
                    self.memory.steps() if options.replay else [])
            data_batch, rng_state = self.memory.get(event.fail_iter)
            if data_batch is None:
                self.logger.error(
                    'mmnanhook: no batch kept for iteration %s: no replay '
                    'and no bundle' % (event.fail_iter, ))
                return event, None
            history = self.history.records() + [self._event_record(event)]
            incident = handle_incident(
                runner, event, data_batch, rng_state, history, options,
                divergence=evidence, start_weight=self.start_weight,
                level=level, rewind=rewind, replays=replays,
                exchange=exchange, config_findings=self.config_findings,
                states=self.states, diagnosers=diagnosers,
                start_attributes=self.memory.attributes(event.fail_iter))
        to_visualizer(getattr(runner, 'visualizer', None), incident.report,
                      incident.pictures, event.iter, self.logger)
        # What the diagnosis allocated is free now: give it back.
        _trim_heap()
        self.logger.info('mmnanhook: diagnosis and bundle took %.2f s' %
                         incident.seconds)
        return event, incident

    # -- a train step whose forward raised ---------------------------------

    def forward_failed(self, exc, train_step):
        """Handle a train step whose forward raised (on this rank or, under
        DDP, on another), as the policy decides.

        Args:
            exc (Exception): What the forward raised (``PeerForwardFailed``
                on a rank whose own forward went fine).
            train_step (callable): ``batch -> outputs``: the model's own
                ``train_step`` with the loop's other arguments.

        Returns:
            dict | None: The outputs of the step skipped (empty) or taken
            again (``'drop'``); ``None``: re-raise ``exc``.
        """
        runner, ranks = self.runner, self.ranks
        peer = isinstance(exc, PeerForwardFailed)
        if self.forward_guard is not None:
            # The others may wait in a collective of this forward first.
            self.forward_guard.abandon(not peer)
        # Every rank votes once, before anything else: the others wait in it.
        failed = exc.ranks if peer else (
            ranks.vote(True) if ranks is not None else None)
        if not peer and (not self.options.replay or is_out_of_memory(exc)):
            if ranks is not None:
                # Every rank stops: this one re-raises, the others learn why.
                Exchange(ranks)(rank_finding(
                    ranks.rank, iter=runner.iter, raises=True,
                    error='%s: %s' % (type(exc).__name__, exc)))
            return None
        event = forward_event(runner.iter, runner.epoch, exc, failed,
                              ranks is not None)
        answer = self.listener.on_nonfinite(event) or Answer()
        sentinel = self.sentinel
        decision = self.policy.after_forward(
            event, answer, sentinel.check.consecutive_skips)
        if decision.action is Action.PROPAGATE:
            if decision.message:
                compat.add_exception_note(exc, decision.message)
            return None
        # The frames' locals hold the failed forward's activations.
        traceback.clear_frames(exc.__traceback__)
        if decision.action is Action.DROP:
            micro = self.micro_buffers or self.buffers
            return self.dropper.again(answer.drop, self.memory.steps(),
                                      train_step, sentinel,
                                      getattr(micro, 'restore', None))
        if decision.action is Action.RAISE:
            raise decision.error(event, answer)
        sentinel.skip(self.handle.wrappers,
                      undo=getattr(self.buffers, 'restore', None))
        return {}


def _trim_heap():
    """Hand the heap pages freed since to the OS (glibc ``malloc_trim``).

    A diagnosis allocates several iterations' worth of activations and
    bundle buffers and frees them all; glibc keeps freed pages in its arenas,
    so the process's resident memory would stay at the diagnosis's peak.
    Elsewhere (no glibc) a no-op.
    """
    try:
        libc = ctypes.CDLL('libc.so.6')
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
