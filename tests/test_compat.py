"""The version shims of :mod:`mmnanhook.compat`."""
import numpy as np
import torch

from mmnanhook import compat
from mmnan_testing import legs


def test_exception_note_keeps_type_and_message():
    exc = RuntimeError('boom')
    compat.add_exception_note(exc, 'extra context')
    assert type(exc) is RuntimeError
    shown = str(exc) + ''.join(getattr(exc, '__notes__', []))
    assert 'boom' in shown and 'extra context' in shown


def test_numpy2_pickles_load_with_any_numpy(tmp_path):
    """A bundle written with numpy>=2 (modern torch) names ``numpy._core``;
    it must load where numpy<2 runs (torch 1.7)."""
    import zipfile
    source, written = str(tmp_path / 'src.pth'), str(tmp_path / 'np2.pth')
    torch.save({'scale_factor': np.array([1.5, 2.0])}, source)
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(written, 'w') as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith('data.pkl'):
                # Protocol-2 GLOBAL opcodes name modules as plain text.
                data = data.replace(b'cnumpy.core.', b'cnumpy._core.')
                assert b'cnumpy._core.' in data
            dst.writestr(info, data)
    np.testing.assert_array_equal(
        legs.torch_load(written)['scale_factor'], [1.5, 2.0])


def test_not_traced_marks_for_dynamo_and_keeps_attributes():
    def step(x):
        """Doc."""
        return x

    step._with_counter = True
    # What functools.wraps of a compiled function copies onto a wrapper.
    step._torchdynamo_orig_callable = len
    done = compat.not_traced(step)
    assert done.__name__ == 'step' and done.__doc__ == 'Doc.'
    assert done._with_counter is True and done(3) == 3
    if not compat.HAS_DYNAMO:
        # torch 1.7: nothing compiles, nothing to exclude.
        assert done is step
        return
    assert done._torchdynamo_disable is True
    # Dynamo's own marker points at the function itself, not at what the
    # copied one named (older torch would have disabled `len` instead).
    assert done._torchdynamo_orig_callable is step
    assert compat.compiled_original(done) is None


def test_compiled_original_is_the_eager_callable():
    def step(x):
        return x + 1

    assert compat.compiled_original(step) is None
    if not compat.HAS_DYNAMO:
        return
    # Compiled lazily: nothing is compiled until it is called.
    assert compat.compiled_original(torch.compile(step)) is step
