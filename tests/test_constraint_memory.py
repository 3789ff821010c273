"""engine/constraints.py: compiled constraints are measured, a too large one is
refused by name, and the cache of compiled ones stays within its bytes."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from trae_groups.engine.constraints import Constraint, Grammars, heap_bytes
from trae_groups.engine.errors import RequestError

MIB = 1 << 20
# ~25 bytes of regex, millions of lexer bytes: the shape of the report's attack
BIG = "^((a{{100}}){{100}}){{{n}}}b{{{k}}}$"
measured = pytest.mark.skipif(heap_bytes() is None, reason="needs glibc's mallinfo2")


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def grammars(tokenizer, **limits) -> Grammars:
    return Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, **limits)


@measured
def test_a_constraint_over_the_limit_is_refused_with_its_size(tokenizer):
    g = grammars(tokenizer, max_bytes=2 * MIB, cache_limit=64 * MIB)
    with pytest.raises(RequestError) as caught:
        g.matcher(Constraint("regex", BIG.format(n=4, k=1)))
    assert caught.value.field == "constraint"
    assert "MiB" in caught.value.message and "max_constraint_bytes" in caught.value.message
    assert "at most 2.0 MiB" in caught.value.message
    assert (g.refusals, g.cache_entries, g.cache_bytes) == (1, 0, 0)
    small = g.matcher(Constraint("regex", "[0-9]{3}"))  # the cache keeps serving
    assert small is not None and g.cache_entries == 1


@measured
def test_the_cache_stays_within_its_bytes_and_the_heap_with_it(tokenizer):
    limit = 12 * MIB
    g = grammars(tokenizer, max_bytes=limit, cache_limit=limit)
    before = heap_bytes()
    sizes = []
    for k in range(24):  # 24 distinct constraints of several MiB each
        g.matcher(Constraint("regex", BIG.format(n=1, k=k + 1)))
        assert g.cache_bytes <= limit
        sizes.append(g.cache_bytes)
    assert max(sizes) > MIB  # each was measured in MiB, not in characters
    assert g.cache_entries < 24  # the oldest were dropped
    # unbounded, 24 of these held ~24x one of them; bounded, the heap grew by about the cache
    assert heap_bytes() - before < 2 * limit


def test_every_compile_has_a_size_of_at_least_its_text(tokenizer):
    g = grammars(tokenizer)
    g.matcher(Constraint("choice", '["refund", "track order"]'))
    assert g.cache_entries == 1 and g.cache_bytes >= len('["refund", "track order"]')
