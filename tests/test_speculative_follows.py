"""Speculative ``follows``: a generation drafts from a text it is likely to copy (another
node's reply that its prompt reads). Greedy output identical to no speculation, on the engine
and through a graph (a plain edge and a streamed one); where the declaration is checked."""

from __future__ import annotations

import json

import pytest
from test_engine import assert_parity, engine, prompts

from conftest import CORPUS
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.spec_config import Reference, SpeculativeConfig
from trae_groups.engine.speculative import FOLLOW_WINDOW, SpecState, follow_propose

MAX_NEW = 24

# -- the proposer ---------------------------------------------------------------------------


def test_the_copy_goes_on_from_where_the_last_proposal_started():
    reference = (10, 11, 12, 13, 14, 15, 16, 17)
    state = SpecState(3, 3)
    # the sequence's last token is the reference's first: the copy starts after it
    assert follow_propose([1, 2, 10], reference, 3, state) == [11, 12, 13]
    # all three kept, and the model's own next token is the reference's too
    assert follow_propose([1, 2, 10, 11, 12, 13, 14], reference, 3, state) == [15, 16, 17]


def test_after_an_edit_the_copy_is_picked_up_again():
    reference = (10, 11, 12, 13, 14, 15, 16, 17, 18)
    state = SpecState(3, 3)
    assert follow_propose([1, 10], reference, 3, state) == [11, 12, 13]
    # 11 kept, then the model wrote 99 instead of 12: nothing to go on from yet
    assert follow_propose([1, 10, 11, 99], reference, 3, state) == []
    # ...until it writes a token of the reference again, close to where the copy was
    assert follow_propose([1, 10, 11, 99, 13], reference, 3, state) == [14, 15, 16]


def test_the_occurrence_ahead_of_the_copy_wins_over_earlier_ones():
    # (5, 6) occurs twice: at 0 and at 6; the copy is past the first one
    reference = (5, 6, 1, 2, 3, 4, 5, 6, 7, 8)
    state = SpecState(2, 2, anchor=4)
    assert follow_propose([9, 5, 6], reference, 2, state) == [7, 8]
    # a single token is not enough far from where the copy was
    far = tuple(range(100, 100 + FOLLOW_WINDOW + 4)) + (42, 43)
    assert follow_propose([9, 42], far, 2, SpecState(2, 2)) == []
    assert follow_propose([9, 41, 42], far, 2, SpecState(2, 2, anchor=FOLLOW_WINDOW)) == [43]


def test_without_the_reference_it_falls_back_to_prompt_lookup():
    state = SpecState(2, 2)
    assert follow_propose([1, 2, 3, 7, 1, 2], (50, 51), 2, state) == [3, 7]


def test_the_cli_and_a_model_do_not_take_follows():
    with pytest.raises(ValueError, match="declared on a graph's generate node"):
        SpeculativeConfig.parse("follows")
    with pytest.raises(ValueError, match="num_tokens: must be an integer in"):
        Reference("text", num_tokens=17)


# -- on the engine --------------------------------------------------------------------------


def test_greedy_output_is_identical_with_references(llama_dir):
    ps = prompts(n=6, seed=21)
    params = SamplingParams(max_tokens=MAX_NEW)
    with engine({"m": llama_dir}) as plain:
        want = plain.generate(ps, params)
        assert plain.llms["m"].speculator is None
    # what each reply is (all kept), another prompt's reply (mostly rejected), an edited one
    refs = [w.token_ids for w in want]
    edited = refs[2][:5] + [7, 8] + refs[2][5:]
    texts = [refs[0], refs[1], edited, refs[4], refs[0], refs[5][::-1]]
    references = [Reference(tuple(t), num_tokens=6) for t in texts]
    with engine({"m": llama_dir}) as eng:
        got = eng.generate(ps, params, references=references)
        counters = eng.llms["m"].speculator.counters
        assert counters.proposed > 0 and 0 < counters.accepted < counters.proposed
        assert eng.pool.stats().used_pages == 0
        # a request without a reference does not speculate on a model set for none
        before = counters.proposed
        assert eng.generate(ps[:2], params)[0].token_ids == want[0].token_ids
        assert counters.proposed == before
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert_parity(llama_dir, got, ps, MAX_NEW)


def test_a_copy_of_the_reply_is_accepted_whole(llama_dir):
    ps = prompts(n=2, seed=22)
    params = SamplingParams(max_tokens=MAX_NEW)
    with engine({"m": llama_dir}) as eng:
        want = eng.generate(ps, params)
        refs = [Reference(tuple(w.token_ids), num_tokens=8) for w in want]
        got = eng.generate(ps, params, references=refs)
        counters = eng.llms["m"].speculator.counters
        assert counters.accepted == counters.proposed > 0
        # fewer verifying steps than tokens: several tokens a step
        assert counters.verify_steps < sum(len(g.token_ids) for g in got) // 2
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_references_beside_ngram_rows_and_opted_out_rows(llama_dir):
    ps = prompts(n=4, seed=23)
    with engine({"m": llama_dir}) as plain:
        want = plain.generate(ps, SamplingParams(max_tokens=MAX_NEW))
    refs = [Reference(tuple(w.token_ids)) for w in want]
    params = [SamplingParams(max_tokens=MAX_NEW, speculative=i != 1) for i in range(4)]
    with engine({"m": llama_dir}, speculative=SpeculativeConfig(num_tokens=3)) as eng:
        got = eng.generate(ps, params, references=[refs[0], refs[1], None, None])
        counters = eng.llms["m"].speculator.counters
        assert counters.off_rows["opted_out"] > 0 and counters.accepted > 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_preemption_and_a_tiny_token_budget_keep_the_output(llama_dir):
    ps = prompts(n=10, seed=24, lo=20, hi=40)
    params = SamplingParams(max_tokens=MAX_NEW)
    with engine({"m": llama_dir}) as plain:
        want = plain.generate(ps, params)
    refs = [Reference(tuple(w.token_ids), num_tokens=8) for w in want]
    # 12 pages of 16 tokens cannot hold 10 sequences of ~50 tokens
    cfg = dict(pool_bytes=12 * 8192, enable_prefix_cache=False)
    with engine({"m": llama_dir}, **cfg) as eng:
        got = eng.generate(ps, params, references=refs)
        assert eng.llms["m"].scheduler.num_preemptions > 0
        assert eng.llms["m"].speculator.counters.reference_accepted > 0
        assert eng.pool.stats().used_pages == 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    with engine({"m": llama_dir}, max_num_batched_tokens=9) as eng:
        got = eng.generate(ps, params, references=refs)
        assert max(eng.llms["m"].counters.batch_tokens) <= 9  # proposals count in it
        assert eng.llms["m"].speculator.counters.reference_accepted > 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_a_reference_of_bad_token_ids_is_refused(llama_dir):
    from trae_groups.engine.errors import RequestError

    with engine({"m": llama_dir}) as eng, pytest.raises(RequestError, match="reference"):
        eng.generate([[5, 6, 7]], references=[Reference((5, 10**9))])


# -- through a graph ------------------------------------------------------------------------

GRAPH = """\
name: rewrite
models:
  llm: {{source: {llm}, task: generate}}
inputs: {{text: str}}
nodes:
  reply:
    model: llm
    prompt: "User: {{{{ inputs.text }}}} Assistant:"
    params: {{max_tokens: 40}}
  rewrite:
    model: llm
{extra}    prompt: "{prompt}"
    params: {{max_tokens: 40}}
outputs: {{reply: reply.text, rewrite: rewrite.text}}
"""
REWRITE = "Rewrite this politely. Text: {{ reply.text }} Polite:"
FOLLOWS = "    speculative: {method: follows, num_tokens: 6}\n"
STREAMED = "    follows: {node: reply, tokens: 8}\n"
TEXTS = ["tell me a story", "the cat sat on the mat", "what is the weather like"]


WORDS = list(
    dict.fromkeys(
        ["<pad>", "<s>", "</s>", "<unk>", *sorted({w for line in CORPUS for w in line.split()})]
    )
)


def build_spaced_words(folder):
    """A word-level tokenizer that splits at white space and joins with one space: a reply's
    text tokenizes back to the reply's own ids, as a real model's text mostly does (a
    random model's byte-level BPE reply holds broken characters, which do not)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    # only the end of a reply is special: every other token is text, so none is lost
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from conftest import build_llm

    folder = tmp_path_factory.mktemp("follows") / "llm"
    return build_llm(folder, "llama", tokenizer=build_spaced_words, vocab_size=len(WORDS))


def graph(llm, extra: str = "", prompt: str = REWRITE) -> str:
    return GRAPH.format(llm=llm, extra=extra, prompt=prompt)


def run_graph(text: str, inputs: list[str]):
    """Each input's outputs, and the model's speculative counters (None: it never drafted)."""
    import asyncio

    from trae_groups.engine import EngineConfig
    from trae_groups.graphs.loader import load_graph_text
    from trae_groups.graphs.runtime import ModelRuntime

    spec = load_graph_text(text, "rewrite.yaml")
    rt = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=16 << 20, fast_linear=False))
    try:
        executor = rt.bind(spec)
        rt.start()
        outputs = [asyncio.run(executor.run({"text": t})).outputs for t in inputs]
        (worker,) = rt.engine.llms.values()
        counters = worker.speculator.counters if worker.speculator is not None else None
        used = rt.engine.pool.stats().used_pages
    finally:
        rt.shutdown()
    return outputs, counters, used


@pytest.mark.parametrize("streamed", [False, True], ids=["plain edge", "streamed edge"])
def test_a_rewrite_drafts_from_the_reply_and_writes_the_same(llm, streamed):
    edge = STREAMED if streamed else ""
    want, none, _ = run_graph(graph(llm, edge), TEXTS)
    assert none is None  # nothing declared: the model never speculates
    got, counters, used = run_graph(graph(llm, edge + FOLLOWS), TEXTS)
    assert got == want
    assert counters.reference_proposed > 0  # proposals came from the reply's text
    assert used == 0


def test_a_rewrite_that_copies_the_reply_drafts_nearly_all_of_it(llm):
    # the prompt reads the reply's text but renders to the reply's own prompt: the rewrite
    # is the reply token for token
    copy = "User: {{ inputs.text }} Assistant:{{ reply.text[:0] }}"
    got, counters, _ = run_graph(graph(llm, FOLLOWS, copy), TEXTS)
    assert all(out["rewrite"] == out["reply"] for out in got)
    # nearly every proposal from the reply is right: the one kind of miss is a suffix that
    # starts in the prompt matching the reply's beginning (one of these replies starts with
    # the prompt's last word twice)
    assert counters.reference_accepted >= 0.9 * counters.reference_proposed > 0
    words = sum(len(out["rewrite"].split()) for out in got)
    assert counters.verify_steps * 3 < words  # several tokens a step


# -- the declaration ------------------------------------------------------------------------

TWO_REPLIES = """\
  other:
    model: llm
    prompt: "{{ inputs.text }}"
"""


def load(text: str):
    from trae_groups.graphs.loader import load_graph_text

    return load_graph_text(text, "rewrite.yaml")


def refused(text: str) -> str:
    from trae_groups.graphs.errors import GraphValidationError

    with pytest.raises(GraphValidationError) as err:
        load(text)
    return str(err.value)


def with_other(text: str) -> str:
    return text.replace("  rewrite:\n", TWO_REPLIES + "  rewrite:\n")


def test_the_node_drafts_from_is_the_one_whose_text_the_prompt_reads(llm):
    from trae_groups.graphs.compile import compile_graph

    assert compile_graph(load(graph(llm, FOLLOWS))).references == {"rewrite": "reply"}
    # several read: the one named; on a streamed edge, the followed one
    both = "{{ other.text }} then {{ reply.text }}"
    named = FOLLOWS.replace("}", ", node: other}")
    assert compile_graph(load(with_other(graph(llm, named, both)))).references == {
        "rewrite": "other"
    }
    streamed = with_other(graph(llm, STREAMED + FOLLOWS, both))
    assert compile_graph(load(streamed)).references == {"rewrite": "reply"}
    assert compile_graph(load(graph(llm))).references == {}


@pytest.mark.parametrize(
    "extra,prompt,message",
    [
        (FOLLOWS, "{{ inputs.text }}", "rewrite.yaml:15: node 'rewrite': method follows drafts "
         "from the text of a generate node the prompt reads ({{ reply.text }}); the prompt of "
         "'rewrite' reads none"),
        (FOLLOWS, "{{ other.text }} {{ reply.text }}", "rewrite.yaml:15: node 'rewrite': the "
         "prompt of 'rewrite' reads the text of 'other' and 'reply'; name the one to draft "
         "from with node:"),
        (FOLLOWS.replace("}", ", node: reply}"), "{{ other.text }}", "the prompt of 'rewrite' "
         "does not read reply.text"),
        (FOLLOWS.replace("}", ", node: replyy}"), REWRITE, "unknown node 'replyy' (did you "
         "mean 'reply'?)"),
        ("    speculative: {method: ngram}\n", REWRITE, "method: a node speculates with "
         "'follows', not 'ngram'"),
        ("    speculative: {num_tokens: 17}\n", REWRITE, "num_tokens"),
    ],
)  # fmt: skip
def test_a_bad_declaration_is_refused_with_its_line(llm, extra, prompt, message):
    text = refused(with_other(graph(llm, extra, prompt)))
    assert message in text, text
    assert "rewrite.yaml:" in text and "rewrite" in text


def test_a_model_does_not_take_follows(llm):
    text = graph(llm).replace("task: generate}", "task: generate, speculative: {method: follows}}")
    message = refused(text)
    assert "rewrite.yaml:3" in message and "declared on a generate node" in message, message


def test_the_dsl_declares_it_the_same_way(llm):
    from trae_groups.dsl import ModelGroup

    group = ModelGroup("rewrite")
    group.add_model("llm", str(llm), task="generate")
    text = group.input("text")
    reply = group.generate("reply", model="llm", prompt=f"User: {text} Assistant:")
    rewrite = group.generate(
        "rewrite",
        model="llm",
        prompt=f"Rewrite: {reply.text}",
        speculative={"method": "follows", "num_tokens": 6, "node": reply},
    )
    group.output("rewrite", rewrite.text)
    declared = group.spec().nodes["rewrite"].speculative
    assert (declared.method, declared.num_tokens, declared.node) == ("follows", 6, "reply")


def test_model_info_says_which_nodes_draft_from_another(llm, tmp_path, capsys):
    from trae_groups.cli import main

    (tmp_path / "rewrite.yaml").write_text(graph(llm, FOLLOWS))
    (tmp_path / "plain.yaml").write_text(graph(llm).replace("name: rewrite", "name: plain"))
    argv = ["model", "info", str(tmp_path / "rewrite.yaml"), str(tmp_path / "plain.yaml")]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # the model is set for no speculation: its speculator comes with the first such request
    assert report["speculative"] == {}
    assert report["follows"] == {
        "llm": [{"node": "rewrite/rewrite", "drafts_from": "rewrite/reply", "num_tokens": 6}]
    }
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    line = (
        "speculative decoding: llm: rewrite/rewrite drafts from the text of rewrite/reply "
        "(follows, up to 6 tokens a step)"
    )
    assert line in lines, lines
