"""The rerank node kind end to end: a tiny cross-encoder, a graph that scores a list
of documents against a query, run through the real runtime and over real HTTP."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from conftest import build_encoder
from trae_groups.engine import EngineConfig
from trae_groups.engine.errors import RequestError
from trae_groups.graphs.errors import NodeError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

RERANK = """
name: search
models:
  rr: {{source: {root}/rr, task: rerank, max_queue_delay_ms: 20}}
inputs:
  q: str
  docs: list[str]
nodes:
  rank: {{model: rr, query: "{{{{ inputs.q }}}}", documents: "{{{{ inputs.docs }}}}"}}
outputs: {{scores: rank.scores, order: rank.order, top: rank.top}}
"""
# documents that render to a string, not a list
NOT_A_LIST = RERANK.replace("name: search", "name: broken").replace(
    'documents: "{{{{ inputs.docs }}}}"', 'documents: "{{{{ inputs.q }}}}"'
)
QUERY = "where is my order"
DOCS = ["ship to paris please", "refund my order now", "hello world", "cheap pills", "my order"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rerank")
    build_encoder(root / "rr", "rerank", ["relevant"], seed=7)
    (root / "search.yaml").write_text(RERANK.format(root=root))
    (root / "broken.yaml").write_text(NOT_A_LIST.format(root=root))
    return root


@pytest.fixture(scope="module")
def runtime(root):
    rt = ModelRuntime(EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    for name in ("search", "broken"):
        path = root / f"{name}.yaml"
        rt.bind(load_graph_text(path.read_text(), str(path)))
    rt.start()
    yield rt
    rt.shutdown()


def direct_scores(folder: Path, query: str, docs: list[str]) -> list[float]:
    """Each pair through transformers alone, one at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return [
            float(model(**tokenizer(query, doc, return_tensors="pt")).logits[0, 0]) for doc in docs
        ]


def test_scores_are_the_cross_encoders_logits_and_order_sorts_them(runtime, root):
    result = asyncio.run(runtime.graphs["search"].run({"q": QUERY, "docs": DOCS}))
    scores, order, top = (result.outputs[k] for k in ("scores", "order", "top"))
    expected = direct_scores(root / "rr", QUERY, DOCS)
    assert len(scores) == len(DOCS)
    assert all(abs(a - b) < 1e-5 for a, b in zip(scores, expected, strict=True)), (scores, expected)
    assert sorted(order) == list(range(len(DOCS)))
    assert [scores[i] for i in order] == sorted(scores, reverse=True)
    assert top == DOCS[order[0]] == DOCS[max(range(len(DOCS)), key=expected.__getitem__)]


def test_pairs_of_concurrent_requests_batch_together(runtime, root):
    queries = [f"{QUERY} {i}" for i in range(8)]
    docs = DOCS[:2]

    async def all_at_once():
        search = runtime.graphs["search"]
        return await asyncio.gather(*(search.run({"q": q, "docs": docs}) for q in queries))

    results = asyncio.run(all_at_once())
    (stats,) = runtime.stats().models.values()
    # a batch larger than one request's pairs holds pairs of several requests
    assert max(stats.batch_sizes) > len(docs)
    for query, result in zip(queries, results, strict=True):
        expected = direct_scores(root / "rr", query, docs)
        assert all(
            abs(a - b) < 1e-5 for a, b in zip(result.outputs["scores"], expected, strict=True)
        )
    assert runtime.engine.pool.stats().used_pages == 0


def test_no_documents_gives_no_scores_and_no_top(runtime):
    result = asyncio.run(runtime.graphs["search"].run({"q": QUERY, "docs": []}))
    assert result.outputs == {"scores": [], "order": [], "top": None}


def test_documents_that_are_not_a_list_fail_the_node_clearly(runtime):
    with pytest.raises(NodeError) as caught:
        asyncio.run(runtime.graphs["broken"].run({"q": QUERY, "docs": DOCS}))
    assert caught.value.node == "rank"
    assert "documents must render to a list of strings" in str(caught.value)


def test_a_pair_the_model_refuses_fails_the_node_with_that_pairs_error(runtime):
    with pytest.raises(NodeError) as caught:
        asyncio.run(runtime.graphs["search"].run({"q": QUERY, "docs": ["my order", " "]}))
    assert caught.value.node == "rank"
    assert isinstance(caught.value.cause, RequestError)  # not an ExceptionGroup (a 500)
    assert "query and document 1: is empty" in str(caught.value)
    assert runtime.engine.pool.stats().used_pages == 0


def test_the_http_api_describes_the_rerank_node_and_its_typed_outputs(root):
    config = ServerConfig(engine=EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    app = create_app([root / "search.yaml"], config)
    with ServerThread(app) as server:
        graph = httpx.get(f"{server.url}/v1/graphs/search").json()
        document = httpx.get(f"{server.url}/openapi.json").json()
        answer = httpx.post(
            f"{server.url}/v1/graphs/search", json={"inputs": {"q": QUERY, "docs": DOCS[:2]}}
        )
        refused = httpx.post(
            f"{server.url}/v1/graphs/search", json={"inputs": {"q": QUERY, "docs": ["a", ""]}}
        )
    assert [(n["name"], n["kind"], n["model"]) for n in graph["nodes"]] == [
        ("rank", "rerank", "rr")
    ]
    assert graph["models"]["rr"]["task"] == "rerank"
    assert graph["inputs"]["properties"]["docs"] == {
        "items": {"type": "string"},
        "title": "Docs",
        "type": "array",
    }
    outputs = graph["outputs"]["properties"]
    assert outputs["scores"]["anyOf"][0] == {"type": "array", "items": {"type": "number"}}
    assert outputs["order"]["anyOf"][0] == {"type": "array", "items": {"type": "integer"}}
    assert outputs["top"]["anyOf"][0] == {"type": ["string", "null"]}
    post = document["paths"]["/v1/graphs/search"]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["inputs"]["properties"]["docs"]["type"] == "array"
    ok = post["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok["properties"]["outputs"] == graph["outputs"]
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["outputs"]["scores"]) == 2
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["node"] == "rank"


SHARED = """
name: shared
models:
  clf: {{source: {root}/clf, task: classify, max_queue_delay_ms: 20}}
  rr: {{source: {root}/rr_shared, task: rerank, max_queue_delay_ms: 20}}
inputs: {{q: str, docs: "list[str]"}}
nodes:
  intent: {{model: clf, input: "{{{{ inputs.q }}}}"}}
  rank: {{model: rr, query: "{{{{ inputs.q }}}}", documents: "{{{{ inputs.docs }}}}"}}
outputs: {{scores: rank.scores, intent: intent.scores}}
"""


def build_shared_backbone(root: Path) -> None:
    """A classifier, and a cross-encoder whose backbone is the classifier's, byte for byte."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    build_encoder(root / "clf", "classify", ["greet", "order", "spam"], seed=5)
    clf = BertForSequenceClassification.from_pretrained(root / "clf")
    config = clf.config.to_dict() | {"id2label": {0: "relevant"}, "label2id": {"relevant": 0}}
    torch.manual_seed(6)
    rr = BertForSequenceClassification(type(clf.config).from_dict(config))
    rr.bert.load_state_dict(clf.bert.state_dict())
    rr.save_pretrained(root / "rr_shared")
    AutoTokenizer.from_pretrained(root / "clf").save_pretrained(root / "rr_shared")


def test_a_classifier_and_a_cross_encoder_on_one_backbone_share_a_worker(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    build_shared_backbone(tmp_path)
    spec = load_graph_text(SHARED.format(root=tmp_path), "shared.yaml")
    rt = ModelRuntime(EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    executor = rt.bind(spec)
    rt.start()
    queries = [f"{QUERY} {i}" for i in range(6)]
    try:

        async def all_at_once():
            return await asyncio.gather(
                *(executor.run({"q": q, "docs": DOCS[:2]}) for q in queries)
            )

        results = asyncio.run(all_at_once())
        (worker,) = rt.stats().models.values()  # one worker: the backbone is held once
        assert worker.counters["items"] == len(queries) * 3
    finally:
        rt.shutdown()
    clf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "clf").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "clf")
    for query, result in zip(queries, results, strict=True):
        with torch.no_grad():
            probs = clf(**tokenizer(query, return_tensors="pt")).logits.softmax(-1)[0].tolist()
        got = list(result.outputs["intent"].values())
        assert all(abs(a - b) < 1e-5 for a, b in zip(got, probs, strict=True))
        expected = direct_scores(tmp_path / "rr_shared", query, DOCS[:2])
        assert all(
            abs(a - b) < 1e-5 for a, b in zip(result.outputs["scores"], expected, strict=True)
        )
