"""Which samples of a preprocessed batch hold non-finite inputs
(:mod:`mmnanhook._inputs`): one sum for a finite batch, exact per sample
otherwise, integer inputs never looked at."""
import pytest
import torch
from mmengine.structures import BaseDataElement

from mmnanhook.errors import NonFiniteInputError
from mmnanhook._inputs import check_inputs, floating, nonfinite_samples


def _images(n, dtype=torch.float32):
    return torch.arange(n * 12, dtype=torch.float32).reshape(n, 3, 2, 2).to(
        dtype)


def test_floating_inputs_are_told_from_integer_ones():
    assert not floating({'inputs': [_images(1, torch.uint8)[0]] * 2})
    assert floating({'inputs': [_images(1)[0]] * 2})
    assert floating({'inputs': {'imgs': _images(2), 'points': [
        torch.zeros(3, dtype=torch.long)]}})
    assert not floating({'data_samples': []})
    assert not floating([_images(2)])


@pytest.mark.parametrize('bad', [float('nan'), float('inf'), -float('inf')])
def test_the_samples_with_a_non_finite_value_are_named(bad):
    stacked = _images(4)
    stacked[1, 2, 1, 0] = bad
    stacked[3, 0, 0, 0] = bad
    assert nonfinite_samples({'inputs': stacked}) == [1, 3]
    listed = list(stacked)
    assert nonfinite_samples({'inputs': listed}) == [1, 3]
    assert nonfinite_samples(
        {'inputs': {'imgs': stacked, 'extra': _images(4)}}) == [1, 3]


def test_a_finite_batch_whose_sum_overflows_is_finite():
    # float16: the sum of finite values overflows to Inf; each value is
    # finite, so no sample is named.
    big = torch.full((2, 3, 8, 8), 60000.0, dtype=torch.float16)
    assert not bool(torch.isfinite(big.sum()))
    assert nonfinite_samples({'inputs': big}) == []


def test_integer_and_finite_inputs_name_nothing():
    assert nonfinite_samples({'inputs': _images(2, torch.uint8)}) == []
    assert nonfinite_samples({'inputs': _images(2)}) == []
    check_inputs({'inputs': _images(2)})


def test_the_error_names_the_samples_and_their_files():
    images = _images(2)
    images[0, 0, 0, 0] = float('nan')
    samples = [BaseDataElement(metainfo=dict(img_path='a/%d.tif' % i))
               for i in range(2)]
    with pytest.raises(NonFiniteInputError) as info:
        check_inputs({'inputs': images, 'data_samples': samples})
    assert info.value.samples == [0]
    assert 'sample 0 (a/0.tif)' in str(info.value)
    assert 'before the forward' in str(info.value)
    # mmyolo's yolov5_collate: data_samples a dict, no file names.
    yolo = {'bboxes_labels': torch.zeros(1, 6)}
    with pytest.raises(NonFiniteInputError) as info:
        check_inputs({'inputs': images, 'data_samples': yolo})
    assert info.value.samples == [0] and '(' not in str(info.value)
