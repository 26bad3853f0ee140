"""What a ``torch.compile``d run did, as dynamo reports it: its
recompilations (``TORCH_LOGS=recompiles``), its graph breaks (dynamo's
counters) and the compiled graphs each train iteration ran.

Nothing of dynamo is replaced: :func:`counting_backend` registers a backend
that hands each graph to a real one (``aot_eager``, ``inductor``) and counts
the calls of what that one compiled.
"""
import contextlib
import logging

from mmengine.hooks import Hook

# Where dynamo (torch 2.x) logs each recompilation, with its reason.
RECOMPILES_LOGGER = 'torch._dynamo.guards.__recompiles'
# What dynamo's counters say of a call to a torch.compiler.disable()d
# function inside a traced frame: our code's graph breaks.
DISABLED_BREAK = 'torch.compiler.disable'


class _Recompiles(logging.Handler):

    def __init__(self):
        super(_Recompiles, self).__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith('Recompiling function'):
            self.messages.append(message)


@contextlib.contextmanager
def dynamo_record():
    """Dynamo's state reset (no cache entry from an earlier run), and what
    the block compiles recorded.

    Yields:
        dict: ``recompiles`` (the messages, each naming the function and
        the guard that failed), filled as the block runs; on exit
        ``graph_breaks`` (reason -> count, over the block's compiles) and
        ``unique_graphs``.
    """
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    handler = _Recompiles()
    logger = logging.getLogger(RECOMPILES_LOGGER)
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    # set_logs also prints them: the test's log is enough.
    propagate, logger.propagate = logger.propagate, False
    record = dict(recompiles=handler.messages)
    try:
        yield record
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        torch._logging.set_logs()
        record['graph_breaks'] = dict(
            (reason.split('\n')[0], n)
            for reason, n in counters['graph_break'].items())
        record['unique_graphs'] = counters['stats']['unique_graphs']
        torch._dynamo.reset()


def recompiled_functions(messages):
    """``(function, file:line)`` of each recompilation message, without the
    guard (which names object ids)."""
    return sorted(m.split('\n')[0][len('Recompiling function '):]
                  for m in messages)


_calls = [0]


def counting_backend(inner='aot_eager'):
    """The name of a registered backend that compiles with ``inner`` and
    counts every call of a graph it compiled (:func:`graph_calls`)."""
    from torch._dynamo.backends.registry import (_COMPILER_FNS,
                                                 lookup_backend,
                                                 register_backend)
    name = 'mmnan_counting_' + inner
    if name in _COMPILER_FNS:
        return name

    def counting(gm, example_inputs):
        compiled = lookup_backend(inner)(gm, example_inputs)

        def run(*args):
            _calls[0] += 1
            return compiled(*args)

        return run

    register_backend(counting, name=name)
    return name


def graph_calls():
    """Calls of graphs compiled by :func:`counting_backend` so far."""
    return _calls[0]


class GraphsPerIter(Hook):
    """The compiled graphs each train iteration ran (from the first hook of
    ``before_train_iter`` to the last of ``after_train_iter``).

    Attributes:
        counts (list[int]): One per iteration.
    """

    priority = 'HIGHEST'

    def __init__(self):
        self.counts = []
        self._start = None

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self._start = graph_calls()

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        self.counts.append(graph_calls() - self._start)
