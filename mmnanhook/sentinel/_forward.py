"""A train step whose forward raised, before any backward.

A forward that raises *because* it made non-finite values (a DETR matcher
handed a NaN cost matrix, SimOTA's cross-entropy of NaN scores, an assertion
on box coordinates) is a trigger like a non-finite loss, and the policy
applies: ``'skip'`` leaves the step out, ``'drop'`` takes it again without
the samples whose data made it raise, ``'raise'`` raises
:class:`~mmnanhook.NonFiniteError` (the original exception is its context),
``'warn'`` lets the original propagate. Any other exception propagates
unchanged, with the diagnosis attached.

Under DDP the rank whose forward raised votes so (:class:`~._distributed.
Ranks`); every other rank learns it in its own vote, before its backward
(:class:`~._distributed.PeerForwardFailed`), and all of them handle the same
event: the ranks that raised diagnose it, every rank exchanges its finding,
and all stop, skip or take the step again alike.
"""
import traceback

from mmengine.dist import get_dist_info

from .. import compat
from ..errors import PeerForwardFailed
from ..records import NonFiniteEvent, Trigger
from ._check import StepContext, answer_text
from ._distributed import Exchange, rank_finding, received


def _is_out_of_memory(exc):
    # Replaying an out-of-memory forward only runs out of memory again.
    return 'out of memory' in str(exc).lower()


def raised_by_nonfinite(kind, forward):
    """Whether a forward that raised did so because of non-finite values
    (its diagnosis found where the forward made them, or a sample whose
    data is not finite): the policy applies, instead of re-raising.

    Args:
        kind (str, optional): The diagnosis' kind.
        forward (dict, optional): Where the forward made a non-finite value.
    """
    return forward is not None or kind == 'data'


def _event(runner, exc, failed, ranks):
    rank, world_size = get_dist_info()
    where = StepContext(runner.iter, runner.epoch).where(rank, world_size)
    if isinstance(exc, PeerForwardFailed):
        message = 'forward of rank(s) %s raised at %s: this rank takes ' \
            'the same path' % (', '.join(map(str, failed)), where)
    else:
        message = '%s raised in forward at %s: %s' % (type(exc).__name__,
                                                      where, exc)
    return NonFiniteEvent(
        Trigger.EXCEPTION, message, iter=runner.iter, epoch=runner.epoch,
        rank=rank, world_size=world_size, bad_ranks=failed,
        exception='%s: %s' % (type(exc).__name__, exc),
        shared=ranks is not None)


def forward_failed(runner, exc, train_step, listener, ranks, replay,
                   steps, sentinel, undo, undo_step, dropper, wrappers):
    """Handle a train step whose forward raised (on this rank or, under
    DDP, on another).

    Args:
        runner (Runner): The runner.
        exc (Exception): What the forward raised
            (:class:`~._distributed.PeerForwardFailed` on a rank whose own
            forward went fine).
        train_step (callable): ``batch -> outputs``: the model's own
            ``train_step`` with the loop's other arguments.
        listener (Listener): Diagnoses the event and answers (with a
            ``drop`` plan and the ranks' ``findings`` when it has them).
        ranks (Ranks, optional): The ranks of a distributed run.
        replay (bool): Whether failures are replayed at all.
        steps (callable): The micro-steps kept since the last update step
            (``StepMemory.steps``).
        sentinel (WrapperSentinel): The optim wrapper's sentinel.
        undo (callable, optional): Puts the buffers (BN running
            statistics) back as they were before the update step's first
            micro-step: a skip.
        undo_step (callable, optional): As they were before the failing
            micro-step: the train step taken again.
        dropper (Dropper, optional): Takes the step again (``'drop'``).
        wrappers (list[OptimWrapper]): Whose gradients a skip zeroes.

    Returns:
        dict | None: The outputs of the step skipped (empty) or taken again
        (``'drop'``); ``None``: re-raise ``exc``.
    """
    peer = isinstance(exc, PeerForwardFailed)
    # Every rank votes once, before anything else: the others wait in it.
    failed = exc.ranks if peer else (
        ranks.vote(True) if ranks is not None else None)
    if not peer and (not replay or _is_out_of_memory(exc)):
        if ranks is not None:
            # Every rank stops: this one re-raises, the others learn why.
            Exchange(ranks)(rank_finding(ranks.rank, iter=runner.iter,
                                         raises=True))
        return None
    event = _event(runner, exc, failed, ranks)
    answer = listener.on_nonfinite(event) or {}
    report = answer.get('report') or {}
    findings = answer.get('findings')
    if findings is not None:
        stops = any(f.raises and not received(f, findings)
                    for f in findings)
    else:
        stops = not raised_by_nonfinite(report.get('kind'),
                                        report.get('forward'))
    extra = answer_text(answer)
    if stops:
        if extra:
            compat.add_exception_note(exc, extra)
        return None
    # The frames' locals hold the failed forward's activations.
    traceback.clear_frames(exc.__traceback__)
    if answer.get('drop') is not None:
        return dropper.again(answer['drop'], steps(), train_step, sentinel,
                             undo_step)
    if not sentinel.check.resolve(event, answer):
        if undo is not None:
            undo()
        for wrapper in wrappers:
            wrapper.zero_grad()
        runner.message_hub.update_scalar('train/nan_skipped',
                                         sentinel.check.skipped)
        return {}
    if extra:
        compat.add_exception_note(exc, extra)
    return None
