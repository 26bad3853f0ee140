"""One training run under ``NanDetectHook``: what it keeps from step to step.

:class:`HookRun` is made in ``before_train`` and dropped when the run ends
(or a train step raises): the checks installed on the optim wrappers (it is
their :class:`~mmnanhook.sentinel.Listener`), the wrapped ``train_step`` and
``parse_losses``, what a trigger needs to replay its iteration (batches, RNG
states, buffers, the history), the snapshots of ``'rewind'``, the dropper and
the quarantine, and what the current step came to. A trigger is carried out
by its :class:`~._trigger.TriggerProcedure`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .. import compat
from .._batch import sample_files
from .._mmengine import is_ddp, unwrap_model
from .._patch import set_attribute
from ..bundle import StateLedger
from ..diagnosis import (Diagnostician, communicating_modules,
                         default_dump_dir, largest_param)
from ..errors import CheckBypassedError, NonFiniteError, RankTimeoutError
from ..options import anomaly_wanted
from ..quarantine import (call_with, flight_dir, live_iterators, prepare_index,
                          read_flights, start_flight, start_quarantine,
                          track_samples)
from ..recovery import Policy, drop_unavailable
from ..report import forget_nonfinite
from .._losses import loss_terms
from ..distributed import start_distributed
from ..memory import (BufferSnapshot, ForwardStart, StepMemory, StepState,
                      step_record)
from ..sentinel import (BypassGuard, Dropper, InputCheck, Listener, Rewinder,
                        install_nan_detect, param_norms)
from ._journal import start_journal
from ._trigger import TriggerProcedure


class HookRun(Listener):
    """The state of one run from step to step; its sentinels' listener.

    Args:
        options (HookOptions): The hook's options.
        runner (Runner): The runner.
        history (History): Where each iteration's scalars go (the hook's:
            it outlives the run).
        config_findings (list[ConfigFinding]): What the config rules found
            in the run's config; a trigger's report names those that
            explain it.
    """

    def __init__(self, options: Any, runner: Any, history: Any,
                 config_findings: Sequence[Any] = ()) -> None:
        self.options = options
        self.policy = Policy(options.check, options.rewind,
                             options.quarantine.quarantine_skips)
        self.runner = runner
        self.logger = runner.logger
        self.handle = install_nan_detect(
            runner.optim_wrapper, listener=self,
            message_hub=runner.message_hub, options=options.check,
            run_policy=self.policy)
        self.guard = BypassGuard(self.handle)
        module = unwrap_model(runner.model)
        # A distributed run's ranks, the guard of its train steps'
        # collectives, and the model's modules that communicate in their
        # forward.
        self.ranks, self.forward_guard, communicating = start_distributed(
            module, communicating_modules, runner.cfg)
        if self.forward_guard is not None and is_ddp(runner.model):
            # DDP's broadcasts from C++ at the start of its forward.
            self.forward_guard.watch(runner.model)
        for sentinel in self.handle.sentinels:
            sentinel.ranks = self.ranks
        # Under DDP too: a rank stopped on entry to its forward answers the
        # others' collectives of theirs (the forward guard).
        self.inputs = InputCheck(module)
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
        # Parameter norms when the current run of spikes began.
        self.spike_norms = None
        # The diagnosis and the quarantine look samples up by file: a large
        # dataset's index is walked in a child process from now on (forked
        # before the snapshot thread below starts).
        self.walks = prepare_index(runner.train_dataloader.dataset)
        # The dataset index of each sample of each batch: what the drop,
        # the quarantine and the record of a step in flight go by.
        self.samples = track_samples(runner.train_dataloader,
                                     live_iterators(runner))
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
        # The work dir's incident journal: rank 0 writes it, with every
        # rank's findings.
        self.journal = start_journal(
            runner, self.ranks is None or self.ranks.rank == 0)
        self.journal.started(
            runner, options.check.policy,
            options.dump_dir or default_dump_dir(runner), self.quarantine,
            self.ranks.world_size if self.ranks is not None else 1)
        if self.journal.writes:
            self.journal.crashed(read_flights(flight_dir(runner.work_dir),
                                              but=self.journal.run))
        # What earlier runs that died inside a step had in flight; this
        # run's record of its own steps.
        self.flight = start_flight(
            runner, self.quarantine if self.policy.quarantines_crashes()
            else None)
        if self.quarantine is not None:
            self.journal.quarantined(self.quarantine.samples)
        # The spike detector of the (first) sentinel: the run's spikes.
        self.spike_detector = self.sentinel.check.spikes
        self.procedure = TriggerProcedure(self, Diagnostician(
            runner, self.memory, options,
            StateLedger(getattr(runner, 'timestamp', None),
                        every=options.dump_state == 'every'),
            communicating, (largest_param(module) or {}).get('max_abs'),
            config_findings, drop_unavailable(len(self.handle.wrappers))),
            communicating)
        # The sentinels hand a trigger straight to the procedure.
        self.on_trigger = self.procedure.update_step
        self.on_backward_raised = self.procedure.backward_raised
        for sentinel in self.handle.sentinels:
            sentinel.settle = self.rewinder.store.settle \
                if self.rewinder is not None else None
        # parse_losses noted for the sentinels (the loss terms); undone by
        # close().
        self._restore_parse = set_attribute(
            module, 'parse_losses', self._wrap_parse_losses(
                module.parse_losses))

    def close(self, how: Optional[str] = None) -> None:
        """Undo every change and let go of what the run kept (again: a
        no-op).

        Args:
            how (str, optional): How the run ended, for the journal
                (``'finished'``, or the error a train step raised); ``None``:
                not known (a run that ended outside a train step).
        """
        if self.journal is not None:
            if how is not None:
                self.journal.ended(self.runner.iter, self.runner.epoch, how)
            self.journal.close()
            self.journal = None
        if self._restore_parse is not None:
            self._restore_parse()
            self._restore_parse = None
        for part in (self.handle, self.inputs, self.quarantine,
                     self.forward_guard, self.flight, self.samples):
            if part is not None:
                part.remove()
        if self.ranks is not None:
            self.ranks.close()
        # A walk still under way is of no use once the run ended.
        for index in self.walks:
            index.close()
        self.walks = []
        self.memory.clear()
        self.buffers = self.micro_buffers = self.parsed = None
        self.settle()
        # Snapshots are memory of the run that ended.
        self.rewinder = self.dropper = None
        self.handle = self.inputs = self.quarantine = self.flight = None
        self.samples = None
        self.forward_guard = self.ranks = None

    def _wrap_parse_losses(self, parse_losses):

        @functools.wraps(parse_losses)
        def nan_detect_parse_losses(*args, **kwargs):
            loss, log_vars = parse_losses(*args, **kwargs)
            # The terms are taken out only for the loss handed to
            # update_params (a replay's are never asked for).
            self.parsed = (loss, log_vars)
            return loss, log_vars

        # Called from inside a compiled train_step.
        return compat.not_traced(nan_detect_parse_losses)

    @property
    def sentinel(self) -> Any:
        """The sentinel of the (first) optim wrapper."""
        return self.handle.sentinels[0]

    # -- per train step ----------------------------------------------------

    def train_step(self, train_step: Callable[..., Any], args: Sequence[Any],
                   kwargs: Dict[str, Any]) -> Any:
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
            indices = self.samples.indices(
                args[0] if args else kwargs.get('data'))
            if self.quarantine is not None:
                # Under DDP every rank takes a step: a batch is never left
                # empty there.
                args, kwargs, indices = self.quarantine.admit(
                    self.runner, args, kwargs, indices,
                    empty=self.ranks is None)
                if args is None:
                    self.step = StepState()
                    return {}
            self._before_step(args[0] if args else kwargs.get('data'),
                              indices)
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
                handled = self.procedure.forward_raised(
                    exc, functools.partial(call_with, eager, args, kwargs))
            if handled is None:
                raise
            return self._logged(handled)
        finally:
            if self.flight is not None:
                self.flight.end()
            if guard is not None:
                guard.end()
            if torch.is_anomaly_enabled() != state[0]:
                compat.restore_anomaly(state)
            self.train_iters += 1

    def _before_step(self, data_batch, indices=None):
        """Keep what a trigger in this train iteration needs to replay it:
        the batch (by reference: ``train_step`` does not mutate it), its
        samples' dataset indices, its RNG states and, when a step may be
        left out, the buffers."""
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
        self.memory.keep(self.runner.iter, data_batch, attributes, indices)
        self.inputs.arm(data_batch)
        if self.flight is not None:
            self.flight.begin(self.runner.iter, self.runner.epoch,
                              sample_files(data_batch), indices)
        self.step = StepState()
        for sentinel in self.handle.sentinels:
            sentinel.outcome = None
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

    def after_iter(self, outputs: Any) -> None:
        """Keep the iteration's history; forget the non-finite scalars of a
        micro-step whose update step will not be applied as it is.
        (Host floats already synced, ours and RuntimeInfoHook's: no sync.)
        """
        for sentinel in self.handle.sentinels:
            outcome = sentinel.outcome
            if outcome is not None:
                # What the update step's check measured, as every rank saw.
                self.step.loss = outcome.loss
                self.step.grad_norm = outcome.grad_norm
                self.step.loss_scale = outcome.loss_scale
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
        if self.step.applied is False:
            return {}
        dropped = self.step.dropped
        return dropped.outputs if dropped is not None else outputs

    def _records(self):
        return sum(s.check.records for s in self.handle.sentinels)

    # -- what the sentinels tell -------------------------------------------

    def loss_terms(self, loss: torch.Tensor
                   ) -> Optional[Dict[str, Any]]:
        parsed, self.parsed = self.parsed, None
        if parsed is None or parsed[0] is not loss:
            return None
        return loss_terms(parsed[1])

    def settle(self) -> None:
        """Wait for the newest snapshot's copy: before anything changes
        the parameters or optimizer state it copies (an update step; EMA's
        swap of the weights for validation)."""
        if self.rewinder is not None:
            self.rewinder.store.settle()

    def on_resolved(self, applied: bool) -> None:
        # A train step that steps several optim wrappers (a GAN) is applied
        # only if each of its update steps is: one left out is not undone by
        # the next one applied (what it returns holds both's values).
        if self.step.applied is not False:
            self.step.applied = applied

    def on_spike(self, spikes: List[Any]) -> None:
        for spike in spikes:
            self.logger.warning('mmnanhook: %r' % (spike, ))
        self.journal.spiked(spikes, self.options.check.spike_policy)
        self.step.spikes = [spike.series for spike in spikes]
        earlier = [s for s in self.spike_detector.spikes[:-len(spikes)]
                   if s.iter >= spikes[0].iter -
                   self.options.check.spike_window]
        if not earlier:
            # The first spike of a run: the norms it is measured from.
            self.spike_norms = self.param_norms()

    def param_norms(self) -> Dict[str, float]:
        """The norms of the model's parameters now."""
        return param_norms(unwrap_model(self.runner.model))

    def event_record(self, event: Any) -> Dict[str, Any]:
        """The history record of ``event``'s iteration."""
        return self._record(loss=event.losses.get('loss'),
                            grad_norm=event.grad_norm,
                            loss_scale=event.loss_scale)
