"""DataLoader workers a test leaves behind, ended as torch ends them.

A runner is freed by the garbage collector (it sits in reference cycles), so
the dataloader iterator of a test that trained with workers dies during some
later test. The collector then runs the worker queues' finalizers (weakref
callbacks: their feeder threads end) before the iterator's ``__del__``, whose
"stop" message to each worker never leaves; it waits
``MP_STATUS_CHECK_INTERVAL`` (5 s) for each before terminating it: 20 s in
whichever test came next after two such runners.
"""
import gc
import multiprocessing


def end_left_workers():
    """Shut down the workers of every multi-process dataloader iterator
    still alive, through the iterator's own shutdown (its workers get their
    stop message and exit at once)."""
    # A started process no longer says what it runs: any child of this
    # process is reason enough to look.
    if not multiprocessing.active_children():
        return
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    for thing in gc.get_objects():
        # type(), not isinstance(): some objects' __class__ is a property
        # with side effects (torch.distributed's deprecated reduce_op warns).
        if issubclass(type(thing), _MultiProcessingDataLoaderIter) and \
                not thing._shutdown:
            thing._shutdown_workers()
