"""The Triton backend against the torch reference and dense attention.

Without a GPU the kernels run through Triton's interpreter, in ONE spawned worker process
started with ``TRITON_INTERPRET=1``. Why a subprocess and not an env var set here: Triton
decides compiled-vs-interpreted once per process, when ``triton.language`` is first
imported (its own helpers such as ``tl.sum`` are jitted then), and by the time pytest
collects this file other test modules have already imported ``trae_groups.kernels`` and
with it triton. Setting the variable in-process would be too late here and would leak
into every later test; the worker keeps both the mode and the cost (~2 s start) to this
file. The parent builds nothing on the worker's behalf: each test sends a small case
spec, the worker returns tensors, the parent asserts.

With CUDA and compiled triton, every case also runs in-process on the GPU (marked gpu).
The whole file skips cleanly when triton is not installed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from test_kernels import make_case

from trae_groups.kernels import naive_attention, paged_attention, store_kv
from trae_groups.kernels import triton_attention as tri

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2.5e-2}


@dataclass(frozen=True)
class Case:
    """One batch: decodes are the leading q_len == 1 sequences."""

    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    heads: int = 4
    kv_heads: int = 2
    page: int = 16
    dim: int = 32
    window: int | None = None
    dtype: str = "float32"
    seed: int = 0
    num_splits: int | None = None
    pool_layout: bool = False  # caches as strided views of a byte pool with NaN garbage


def pool_views(k: torch.Tensor, v: torch.Tensor, layers: int = 3, layer: int = 1, pad: int = 192):
    """Copies of k/v living in a byte pool the way engine.memory_pool.KVView lays it out:
    [pages, layers, 2, tokens, kv_heads, dim] inside byte-sized pages with a padded tail, so
    the page stride is not tokens*kv_heads*dim. Unwritten bytes are 0xFF: NaN in every float
    dtype, so a kernel that reads a slot it should mask fails loudly."""
    pages, page, kvh, dim = k.shape
    used = layers * 2 * page * kvh * dim * k.element_size()
    buf = torch.full((pages, used + pad), 0xFF, dtype=torch.uint8, device=k.device)
    shaped = buf[:, :used].view(k.dtype).unflatten(1, (layers, 2, page, kvh, dim))
    kv, vv = shaped[:, layer, 0], shaped[:, layer, 1]
    assert kv.stride(0) != page * kvh * dim
    return kv, vv


def run_case(case: Case, device: str) -> dict[str, torch.Tensor]:
    """Build the batch, store K/V with the Triton kernel, attend; returns what to compare."""
    dtype = DTYPES[case.dtype]
    q, k, v, kc, vc, batch, keys, values = make_case(
        list(case.q_lens),
        list(case.ctx_lens),
        case.heads,
        case.kv_heads,
        page=case.page,
        dim=case.dim,
        seed=case.seed,
        num_pages=sum(-(-c // case.page) for c in case.ctx_lens) + 3,
    )
    q, k, v, kc, vc = (t.to(dtype) for t in (q, k, v, kc, vc))
    keys = [t.to(dtype) for t in keys]
    values = [t.to(dtype) for t in values]
    scale = case.dim**-0.5
    ref_kc, ref_vc = kc.clone(), vc.clone()  # the reference path's own pages
    store_kv(k, v, ref_kc, ref_vc, batch.slot_mapping)
    want_ref = paged_attention(q, k, v, ref_kc, ref_vc, batch, scale, case.window)
    dev = torch.device(device)
    q, k, v, kc, vc = (t.to(dev) for t in (q, k, v, kc, vc))
    if case.pool_layout:  # built on the device: .to() would make a strided view contiguous
        kc, vc = pool_views(kc, vc)
        for s, (n_q, n_k) in enumerate(zip(case.q_lens, case.ctx_lens, strict=True)):
            for pos in range(n_k - n_q):  # only cached tokens are written; the rest is NaN
                page = int(batch.block_tables[s, pos // case.page])
                kc[page, pos % case.page] = ref_kc[page, pos % case.page]
                vc[page, pos % case.page] = ref_vc[page, pos % case.page]
    batch.slot_mapping = batch.slot_mapping.to(dev)
    batch.block_tables = batch.block_tables.to(dev)
    batch.context_lens_t = batch.context_lens_t.to(dev)
    tri.store_kv(k, v, kc, vc, batch.slot_mapping)
    got = tri.paged_attention(
        q, k, v, kc, vc, batch, scale, case.window, num_splits=case.num_splits
    )
    dense = naive_attention(
        q.cpu().float(),
        [t.float() for t in keys],
        [t.float() for t in values],
        batch.query_starts,
        scale,
        case.window,
    )
    return {"got": got.cpu(), "reference": want_ref, "dense": dense}


MODES = [
    "interpreter",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not (torch.cuda.is_available() and tri.HAVE_TRITON and not tri.INTERPRETED),
                reason="needs CUDA and compiled triton",
            ),
        ],
    ),
]


@pytest.fixture(params=MODES)
def run(request):
    """run(case) -> dict of tensors, on the interpreter worker or in-process on CUDA."""
    if request.param == "cuda":
        return lambda case: run_case(case, "cuda")
    pool = request.getfixturevalue("interpreter")
    return lambda case: pool.submit(run_case, case, "cpu").result(timeout=280)


def check(res: dict[str, torch.Tensor], case: Case) -> None:
    tol = TOL[case.dtype]
    got = res["got"].float()
    assert torch.isfinite(got).all(), "non-finite output"
    torch.testing.assert_close(got, res["dense"], atol=tol, rtol=tol)
    if not case.pool_layout:  # the reference reads stale page tails and chokes on NaN
        torch.testing.assert_close(got, res["reference"].float(), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------

MIXED = Case(q_lens=(1, 1, 1, 7, 5, 4), ctx_lens=(1, 4, 13, 7, 11, 4), page=4, dim=8)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("window", [None, 5])
def test_mixed_decode_and_prefill_gqa(run, group, window):
    # decodes at and inside page boundaries, a fresh prefill, a chunk over cached context
    case = replace(MIXED, heads=2 * group, kv_heads=2, window=window)
    check(run(case), case)


def _random_case(seed: int) -> Case:
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    n_dec, n_pre = (
        int(torch.randint(0, 5, (1,), generator=g)),
        int(torch.randint(1, 3, (1,), generator=g)),
    )
    ctx = torch.randint(1, 320, (n_dec + n_pre,), generator=g).tolist()
    q_lens = [1] * n_dec + [int(torch.randint(1, c + 1, (1,), generator=g)) for c in ctx[n_dec:]]
    q_lens = [
        max(q, 2) if i >= n_dec and c >= 2 else q
        for i, (q, c) in enumerate(zip(q_lens, ctx, strict=True))
    ]
    group, kv_heads = pick([1, 2, 4, 8]), pick([1, 2])
    return Case(
        q_lens=tuple(q_lens),
        ctx_lens=tuple(ctx),
        heads=group * kv_heads,
        kv_heads=kv_heads,
        page=pick([8, 16, 32]),
        dim=pick([32, 64]),
        window=pick([None, None, 17, 100]),
        seed=seed,
    )


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(run, seed):
    case = _random_case(seed)
    check(run(case), case)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(run, dtype):
    case = Case(
        q_lens=(1, 1, 1, 90, 33),
        ctx_lens=(40, 130, 7, 90, 150),
        heads=8,
        kv_heads=2,
        dim=64,
        window=64,
        dtype=dtype,
        seed=3,
    )
    check(run(case), case)


@pytest.mark.parametrize("splits", [2, 5])
def test_decode_split_keys(run, splits):
    # flash-decoding: key ranges per program merged by the reduce kernel, incl. empty splits
    case = Case(
        q_lens=(1, 1, 1),
        ctx_lens=(300, 9, 170),
        heads=8,
        kv_heads=2,
        dim=64,
        num_splits=splits,
        seed=4,
    )
    check(run(case), case)
    windowed = replace(case, window=50)
    check(run(windowed), windowed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pool_layout_and_stale_nan_bytes(run, dtype):
    # byte-pool strides (page stride != tokens*heads*dim) and NaN in every unwritten slot
    case = Case(
        q_lens=(1, 1, 20, 6),
        ctx_lens=(17, 33, 20, 40),
        heads=4,
        kv_heads=1,
        dim=32,
        window=None,
        dtype=dtype,
        pool_layout=True,
        seed=5,
    )
    check(run(case), case)


def test_odd_head_dim_and_page_size(run):
    # head_dim padded to a power of two in-kernel; pages need not be a power of two
    case = Case(
        q_lens=(1, 1, 9, 30),
        ctx_lens=(25, 3, 30, 47),
        heads=6,
        kv_heads=3,
        page=12,
        dim=40,
        window=10,
        seed=6,
    )
    check(run(case), case)


def test_only_decodes_and_only_prefill(run):
    dec = Case(q_lens=(1,) * 5, ctx_lens=(1, 16, 17, 64, 100), heads=8, kv_heads=8, seed=7)
    check(run(dec), dec)
    pre = Case(q_lens=(64, 2, 100), ctx_lens=(64, 2, 130), heads=4, kv_heads=4, seed=8)
    check(run(pre), pre)


def test_long_context(run):
    # a 2,304-token context: a 256-row chunk over 2,048 cached tokens, plus long decodes
    # (float16: the GPU's 64-wide tiles; fp32's 32-wide ones make the interpreter 3x slower)
    case = Case(
        q_lens=(1, 1, 256),
        ctx_lens=(2304, 1500, 2304),
        heads=4,
        kv_heads=1,
        dim=64,
        dtype="float16",
        seed=9,
    )
    check(run(case), case)


def _engine_tokens(model_dir: str, backend: str) -> list[list[int]]:
    """Greedy tokens of the real engine (real KVView pages, real PagedBatch, chunked prefill)."""
    from trae_groups.engine import EngineConfig, LLMEngine, SamplingParams

    gen = torch.Generator().manual_seed(11)
    lens = torch.randint(30, 51, (4,), generator=gen).tolist()
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lens]
    config = EngineConfig(
        pool_bytes=4 << 20, fast_linear=False, max_num_batched_tokens=32, attention_backend=backend
    )
    with LLMEngine({"m": model_dir}, config) as engine:
        # NaN in every byte: both backends take pages without zeroing them
        engine.pool.buffer.fill_(0xFF)
        outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        assert engine.backend.name == backend
        assert engine.llms["m"].scheduler.zero_pages is False
    return [o.token_ids for o in outs]


@pytest.mark.slow
def test_engine_greedy_tokens_match_the_torch_backend(interpreter, tmp_path):
    # Mistral: sliding window 24 on every layer; prompts and outputs cross it
    from conftest import build_llm

    model_dir = str(build_llm(tmp_path / "mistral", "mistral"))
    want = interpreter.submit(_engine_tokens, model_dir, "torch").result(timeout=280)
    got = interpreter.submit(_engine_tokens, model_dir, "triton").result(timeout=280)
    assert got == want


# ---------------------------------------------------------------------------------------
# in-process: registry and argument checks (no kernel runs)
# ---------------------------------------------------------------------------------------


def test_registry_keeps_torch_default_on_cpu():
    from trae_groups.kernels import available_backends, select_backend

    if tri.INTERPRETED:  # whole run started with TRITON_INTERPRET=1
        assert select_backend("cpu").name == "triton"
    else:
        assert "triton" not in available_backends("cpu")
        assert select_backend("cpu").name == "torch"
        with pytest.raises(ValueError, match="not available"):
            select_backend("cpu", prefer="triton")


def _small():
    q, k, v, kc, vc, batch, *_ = make_case([1, 3], [5, 3], 4, 2)
    return q, k, v, kc, vc, batch


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(q=a["q"][..., :4]), "query: expected shape"),
        (lambda a: a.update(k=a["k"][:, :1]), "key: expected shape"),
        (lambda a: a.update(q=a["q"][:, :3]), "not a multiple"),
        (lambda a: a.update(q=a["q"].double()), "dtype"),
        (lambda a: a.update(q=a["q"].half()), "query is torch.float16"),
        (lambda a: a.update(vc=a["vc"][:, :2]), "equal shapes"),
        (lambda a: a.update(kc=a["kc"].half(), vc=a["vc"].half()), "query is torch.float32"),
        (lambda a: setattr(a["batch"], "tokens_per_page", 8), "tokens_per_page"),
        (
            lambda a: setattr(a["batch"], "block_tables", a["batch"].block_tables.float()),
            "block_tables",
        ),
        (lambda a: setattr(a["batch"], "block_tables", a["batch"].block_tables[:, :1]), "columns"),
        (lambda a: setattr(a["batch"], "query_starts", [0, 1, 3]), "query_starts"),
        (lambda a: setattr(a["batch"], "num_decodes", 2), "num_decodes"),
        (lambda a: a.update(window=0), "sliding_window"),
    ],
)
def test_paged_attention_rejects_bad_arguments(mutate, match):
    q, k, v, kc, vc, batch = _small()
    args = {"q": q, "k": k, "v": v, "kc": kc, "vc": vc, "batch": batch, "window": None}
    mutate(args)
    with pytest.raises(ValueError, match=match):
        tri.paged_attention(
            args["q"],
            args["k"],
            args["v"],
            args["kc"],
            args["vc"],
            args["batch"],
            0.5,
            args["window"],
        )


def test_store_kv_rejects_bad_arguments():
    _, k, v, kc, vc, batch = _small()
    with pytest.raises(ValueError, match="slot_mapping has"):
        tri.store_kv(k, v, kc, vc, batch.slot_mapping[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        tri.store_kv(k, v, kc, vc, batch.slot_mapping.float())
    with pytest.raises(ValueError, match="value: expected shape"):
        tri.store_kv(k, v[:, :, :4], kc, vc, batch.slot_mapping)


@pytest.mark.skipif(tri.INTERPRETED, reason="this process runs triton interpreted")
def test_cpu_tensors_without_interpreter_say_how():
    q, k, v, kc, vc, batch = _small()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tri.paged_attention(q, k, v, kc, vc, batch, 0.5)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tri.store_kv(k, v, kc, vc, batch.slot_mapping)


def _store_case() -> dict[str, torch.Tensor]:
    kc = torch.zeros(3, 4, 2, 8)
    vc = torch.zeros_like(kc)
    k = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([5, -1, 11, 0])  # -1: padding, skipped
    tri.store_kv(k, -k, kc, vc, slots)
    return {"kc": kc, "vc": vc, "k": k}


def test_store_kv_scatters_and_skips_padding(interpreter):
    res = interpreter.submit(_store_case).result(timeout=120)
    kc, vc, k = res["kc"], res["vc"], res["k"]
    torch.testing.assert_close(kc[1, 1], k[0])
    torch.testing.assert_close(kc[2, 3], k[2])
    torch.testing.assert_close(kc[0, 0], k[3])
    torch.testing.assert_close(vc[2, 3], -k[2])
    assert kc.count_nonzero() == 3 * 2 * 8  # the -1 row wrote nothing


# ---------------------------------------------------------------------------------------
# compiled path without a GPU: lower every kernel to a Hopper cubin (bundled ptxas)
# ---------------------------------------------------------------------------------------

_PTR = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
_INDEX_PTRS = {"table_ptr": "*i64", "ctx_ptr": "*i64", "slot_ptr": "*i64"}
_I32_PTRS = ("starts_ptr", "tile_seq_ptr", "tile_row_ptr")
_OPTIONS = ("num_warps", "num_stages")


def _compile_sm90(fn, dtype: str, consts: dict, pointers: dict | None = None) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {k: v for k, v in consts.items() if k not in _OPTIONS}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in (pointers or {}):
            signature[name] = pointers[name]
        elif name in _INDEX_PTRS:
            signature[name] = _INDEX_PTRS[name]
        elif name in _I32_PTRS:
            signature[name] = "*i32"
        elif name.startswith("part_"):
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = _PTR[dtype]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {k: consts[k] for k in _OPTIONS if k in consts}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm.get("cubin"), "no cubin produced"
    # fits the smallest shared memory of the GPUs we target (sm_86/89: 99 KiB per block)
    assert compiled.metadata.shared <= 99 * 1024, f"{fn.__name__}: {compiled.metadata.shared} B"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.skipif(tri.INTERPRETED, reason="this process runs triton interpreted")
@pytest.mark.parametrize(
    "dtype,group,dim,window",
    [("bfloat16", 4, 128, False), ("float16", 8, 64, True), ("float32", 1, 80, True)],
)
def test_kernels_compile_for_hopper(dtype, group, dim, window):
    # the interpreter cannot see compile-only rules (dot tile minima, loop-carried types,
    # shared memory): lower the exact launch constants paged_attention uses
    consts = tri.launch_constants(DTYPES[dtype], group, dim, 16, window)
    _compile_sm90(tri._decode_kernel, dtype, {**consts["decode"], "SPLIT": True})
    graph = {**consts["decode"], "SPLIT": True, "ROW_CHUNK": True}  # graph_decode's launch
    _compile_sm90(tri._decode_kernel, dtype, graph)
    _compile_sm90(tri._prefill_kernel, dtype, consts["prefill"])
    if dtype == "bfloat16":
        _compile_sm90(tri._reduce_splits_kernel, dtype, {**consts["reduce"], "BLOCK_S": 8})
        _compile_sm90(
            tri._store_kv_kernel,
            dtype,
            dict(PAGE=16, HEAD_DIM=dim, HEAD_ELEMS=2 * dim, BLOCK_T=16, BLOCK_HD=2 * dim),
        )


# ---------------------------------------------------------------------------------------
# int8 KV pages (trae_kernels/kv_quant.py): the Triton kernels against the torch reference
# ---------------------------------------------------------------------------------------


def run_int8_case(case: Case) -> dict[str, torch.Tensor]:
    """Cached tokens quantized into int8 pages; the new ones stored by each backend's own
    store_kv; both attend over the int8 pages."""
    from trae_groups.kernels.kv_quant import QuantKV, quantize

    q, k, v, kc, vc, batch, keys, values = make_case(
        list(case.q_lens), list(case.ctx_lens), case.heads, case.kv_heads, page=case.page,
        dim=case.dim, seed=case.seed, num_pages=sum(-(-c // case.page) for c in case.ctx_lens) + 3,
    )  # fmt: skip

    def caches():
        return tuple(QuantKV(*quantize(c, torch.int8), torch.float32) for c in (kc, vc))

    scale = case.dim**-0.5
    (rk, rv), (tk, tv) = caches(), caches()
    store_kv(k, v, rk, rv, batch.slot_mapping)
    want = paged_attention(q, k, v, rk, rv, batch, scale, case.window)
    tri.store_kv(k, v, tk, tv, batch.slot_mapping)
    got = tri.paged_attention(q, k, v, tk, tv, batch, scale, case.window)
    dense = naive_attention(q, keys, values, batch.query_starts, scale, case.window)
    return {"got": got, "reference": want, "dense": dense, "values": (tk.values, rk.values),
            "scales": (tk.scale, rk.scale)}  # fmt: skip


@pytest.mark.parametrize("window", [None, 5])
def test_int8_kv_pages_match_the_torch_reference(interpreter, window):
    case = replace(MIXED, heads=4, kv_heads=2, window=window, dim=16)
    res = interpreter.submit(run_int8_case, case).result(timeout=280)
    # the same quantization: scales equal, values equal but for rounding ties (+-1)
    torch.testing.assert_close(*res["scales"], atol=0, rtol=0)
    assert int((res["values"][0].int() - res["values"][1].int()).abs().max()) <= 1
    # reading the same int8 pages: only summation order differs. (The reference's fresh
    # prefills read the new float K/V, not the pages: hence the looser bound for those rows.)
    torch.testing.assert_close(res["got"], res["reference"], atol=2e-2, rtol=2e-2)
    # against float attention: int8 with a per-token, per-head scale is ~0.4% per value
    torch.testing.assert_close(res["got"], res["dense"], atol=3e-2, rtol=3e-2)


_INT8_PAGES = {"k_cache_ptr": "*i8", "v_cache_ptr": "*i8", "cache_ptr": "*i8",
               "k_scale_ptr": "*fp16", "v_scale_ptr": "*fp16", "scale_ptr": "*fp16"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.skipif(tri.INTERPRETED, reason="this process runs triton interpreted")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_int8_kv_kernels_compile_for_hopper(dtype):
    consts = tri.launch_constants(DTYPES[dtype], 4, 128, 16, True, kv_quant=True)
    _compile_sm90(tri._decode_kernel, dtype, {**consts["decode"], "SPLIT": False}, _INT8_PAGES)
    _compile_sm90(tri._prefill_kernel, dtype, consts["prefill"], _INT8_PAGES)
    store = dict(PAGE=16, HEAD_DIM=128, QMAX=127.0, MIN_SCALE=2.0**-24, BLOCK_T=32, BLOCK_D=128)
    _compile_sm90(tri._store_kv_int8_kernel, dtype, store, _INT8_PAGES)


# ---------------------------------------------------------------------------------------
# graph_decode: the launch a captured decode step replays (engine/decode_graphs.py)
# ---------------------------------------------------------------------------------------


def run_graph_decode_case(dtype: str, window: int | None, int8: bool, splits: int) -> dict:
    """Three real rows then two padding rows (slot -1, length 0), block tables wider than any
    row needs (a graph's are as wide as the longest sequence a model admits); contexts long
    enough that every one of ``splits`` key splits has work in the longest row."""
    from trae_groups.kernels.attention import PagedBatch, graph_decode
    from trae_groups.kernels.kv_quant import QuantKV, quantize

    torch.manual_seed(1)
    pages, page, kv_heads, heads, dim, width, lens = 80, 8, 2, 8, 16, 24, [70, 150, 1]
    n, rows = len(lens), len(lens) + 2
    tables = torch.zeros(rows, width, dtype=torch.long)
    tables[:n] = torch.randperm(pages)[: n * width].view(n, width)
    slots = torch.full((rows,), -1)
    for r, length in enumerate(lens):
        slots[r] = tables[r, (length - 1) // page] * page + (length - 1) % page
    lens_t = torch.tensor(lens + [0, 0])
    q, k, v = (
        torch.randn(rows, heads, dim),
        torch.randn(rows, kv_heads, dim),
        torch.randn(rows, kv_heads, dim),
    )
    q, k, v = (t.to(DTYPES[dtype]) for t in (q, k, v))
    plain = [torch.randn(pages, page, kv_heads, dim).to(DTYPES[dtype]) for _ in range(2)]

    def caches():
        if int8:
            return [QuantKV(*quantize(c, torch.int8), DTYPES[dtype]) for c in plain]
        return [c.clone() for c in plain]

    (gk, gv), (ek, ev), (rk, rv) = caches(), caches(), caches()
    got = tri.graph_decode(q, k, v, gk, gv, slots, tables, lens_t, 0.25, window, num_splits=splits)
    tri.store_kv(k[:n], v[:n], ek, ev, slots[:n])
    batch = PagedBatch(slots[:n], list(range(n + 1)), lens, tables[:n], n, page, lens_t[:n])
    eager = tri.paged_attention(q[:n], k[:n], v[:n], ek, ev, batch, 0.25, window, num_splits=1)
    ref = None if int8 else graph_decode(q, k, v, rk, rv, slots, tables, lens_t, 0.25, window)
    stored = (gk.values, ek.values) if int8 else (gk, ek)
    return {"got": got, "eager": eager, "reference": ref, "stored": stored}


@pytest.mark.parametrize(
    "dtype,window,int8,splits",
    [("float32", None, False, 1), ("float32", None, False, 5), ("bfloat16", 40, False, 3),
     ("float32", 40, True, 4)],
)  # fmt: skip
def test_graph_decode_matches_the_eager_kernel_and_the_reference(
    interpreter, dtype, window, int8, splits
):
    res = interpreter.submit(run_graph_decode_case, dtype, window, int8, splits).result(timeout=280)
    tol = TOL[dtype]
    got = res["got"].float()
    torch.testing.assert_close(got[:3], res["eager"].float(), atol=tol, rtol=tol)
    assert torch.equal(got[3:], torch.zeros_like(got[3:]))  # padding rows: zeros, not NaN
    assert torch.equal(*res["stored"])  # padding stored nothing, real rows what eager stores
    if res["reference"] is not None:
        torch.testing.assert_close(got, res["reference"].float(), atol=tol, rtol=tol)


def _graph_engine_tokens(model_dir: str, backend: str, graphs: bool) -> list[list[int]]:
    """Greedy tokens of the real engine, its decode steps through DecodeGraphs (replayed
    eagerly: no capture on CPU) on this backend's graph_decode, or all eager."""
    from trae_groups.engine import EngineConfig, LLMEngine, SamplingParams
    from trae_groups.engine.decode_graphs import DecodeGraphs, replay_eagerly

    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 30, 17)]
    # graphs capture transformers' forward (what GPUs run): the CPU flat forward stays off
    config = EngineConfig(
        pool_bytes=4 << 20, fast_linear=False, attention_backend=backend,
        model_forward="transformers",
    )  # fmt: skip
    with LLMEngine({"m": model_dir}, config) as engine:
        engine.pool.buffer.fill_(0xFF)  # NaN in every byte, as in the eager engine test
        runner = engine.llms["m"].runner
        if graphs:
            runner.enable_graphs((1, 2, 4), engine.llms["m"].max_model_len, replay_eagerly)
            assert isinstance(runner.compiled, DecodeGraphs)
        outs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
        assert not graphs or (
            runner.compiled.steps > 0 and isinstance(runner.compiled, DecodeGraphs)
        )
    return [o.token_ids for o in outs]


@pytest.mark.slow
def test_engine_decode_graphs_on_triton_match_the_torch_backend(interpreter, tmp_path):
    # Mistral: a sliding window of 24; prompts and outputs cross it
    from conftest import build_llm

    model_dir = str(build_llm(tmp_path / "mistral", "mistral"))
    want = interpreter.submit(_graph_engine_tokens, model_dir, "torch", False).result(timeout=280)
    got = interpreter.submit(_graph_engine_tokens, model_dir, "triton", True).result(timeout=280)
    assert got == want
