"""Media: the rows, positions and prefix-cache keys of a prompt's images (appliance/runtime/media.py)."""

import numpy as np
import pytest

from appliance.runtime.media import ImageSpan, Media


def _image(start: int, length: int, digest: bytes, hidden: int = 4) -> ImageSpan:
    rows = np.arange(length * hidden, dtype=np.float32).reshape(length, hidden) + start
    return ImageSpan(start, length, digest, rows)


def test_rows_of_a_range_cut_across_images():
    media = Media((_image(2, 3, b"a" * 16), _image(7, 2, b"b" * 16)), prompt_len=10)
    offsets, rows = media.rows(3, 8)
    assert offsets.tolist() == [0, 1, 4]  # positions 3, 4 (first image), 7 (second)
    assert np.array_equal(rows, np.concatenate([media.images[0].features[1:3], media.images[1].features[:1]]))
    assert media.rows(5, 7) is None and media.rows(0, 2) is None


def test_mrope_positions_continue_past_the_prompt_with_the_delta():
    mrope = np.stack([np.arange(5), np.arange(5) * 2, np.arange(5) * 3]).astype(np.int64)
    media = Media((), prompt_len=5, mrope=mrope, rope_delta=-2)
    got = media.position_ids(3, 7)
    assert got.tolist() == [[3, 4, 3, 4], [6, 8, 3, 4], [9, 12, 3, 4]]
    assert Media((), prompt_len=5).position_ids(0, 5) is None


def test_keys_follow_the_picture_not_the_placeholder():
    tokens = [1, 2, 9, 9, 9, 3]
    same = Media((_image(2, 3, b"x" * 16),), 6).key_tokens(tokens, 0)
    again = Media((_image(2, 3, b"x" * 16),), 6).key_tokens(tokens, 0)
    other = Media((_image(2, 3, b"y" * 16),), 6).key_tokens(tokens, 0)
    assert same == again and same != other
    assert same[:2] == (1, 2) and same[5] == 3 and all(k < 0 for k in same[2:5]) and len(set(same[2:5])) == 3
    assert Media((_image(2, 3, b"x" * 16),), 6).key_tokens(tokens[3:], 3) == same[3:]  # a block's slice


def test_inconsistent_media_is_refused():
    with pytest.raises(ValueError):
        ImageSpan(0, 2, b"d" * 16, np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError):
        Media((_image(0, 3, b"a" * 16), _image(2, 2, b"b" * 16)), prompt_len=5)
    with pytest.raises(ValueError):
        Media((), prompt_len=4, mrope=np.zeros((3, 3), np.int64))
