"""TokenIdArray: a sequence's read token ids as int64, each converted once."""

import numpy as np
import pytest

from detlora.engine.token_id_array import TokenIdArray


def test_it_follows_the_list_as_the_engine_grows_it():
    ids = list(range(100, 170))  # a prompt longer than the first capacity
    mirror = TokenIdArray()
    assert mirror.known(ids).tolist() == ids
    ids.append(-1)  # a step launched ahead: its token is not read
    assert mirror.known(ids).tolist() == ids[:-1]
    ids[-1] = 7  # read
    ids.append(-1)
    assert mirror.known(ids).tolist() == ids[:-1]
    del ids[-1:]  # finished first: the unread token is dropped
    assert mirror.known(ids).tolist() == ids
    for t in range(300):  # grows past several capacities
        ids.append(t)
        got = mirror.known(ids)
        assert got.dtype == np.int64 and got.tolist() == ids


def test_each_id_is_converted_once():
    ids = [1, 2, 3]
    mirror = TokenIdArray()
    mirror.known(ids)
    ids[0] = 99  # never done by the engine: shows that read entries are not converted again
    ids.append(4)
    assert mirror.known(ids).tolist() == [1, 2, 3, 4]


def test_an_unread_token_before_the_last_is_refused():
    with pytest.raises(RuntimeError, match="only the last token"):
        TokenIdArray().known([1, -1, 2])
    assert TokenIdArray().known([]).size == 0 and TokenIdArray().known([-1]).size == 0
