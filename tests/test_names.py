"""graphs/types.py: the one rule for names (graph, model, version, adapter)."""

from __future__ import annotations

import pytest

from trae_groups.graphs.types import MAX_NAME_CHARS, slug


@pytest.mark.parametrize("name", ["v2\n", "v2\r\n", "\nv2", "v 2", "", "v" * (MAX_NAME_CHARS + 1)])
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError, match="name"):
        slug(name)


@pytest.mark.parametrize("name", ["v2", "v2.1-rc_3", "v" * MAX_NAME_CHARS])
def test_good_names_pass(name):
    assert slug(name) == name


def test_the_length_limit_is_in_the_message():
    with pytest.raises(ValueError, match=f"at most {MAX_NAME_CHARS}"):
        slug("v" * 1000)
