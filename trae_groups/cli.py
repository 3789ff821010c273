"""The ``trae`` command (alias ``trae-cli``).

    trae serve GRAPH.yaml... [--host H] [--port P] [--pool-bytes 512MiB]
    trae serve GRAPH.yaml... --ray [ADDRESS]   on a Ray cluster (--ray-config: its Serve config)
    trae run GRAPH.yaml --input '{"text": "hi"}' [--outputs a,b] [--stream]
    trae validate GRAPH.yaml...          exit 1 with file:line messages when invalid
    trae show GRAPH.yaml [--format text|mermaid|dot|png] [--output FILE]
    trae model info GRAPH.yaml... [--detail] [--json]
    trae model route MODEL [--graph G] [--split "v1:90%,v2:10%"] [--url URL] [--token T]
    trae health [--url URL]
    trae profile plot FILE [-o mem.png]    a memory profile (serve --memory-profile) as a chart
    trae bench GRAPH.yaml --clients N --requests M [--url URL] [--input JSON]

Commands that only read graphs (validate, show, health) import neither torch nor model code, so
they answer at once. Results go to stdout as JSON; logs and errors go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import logging
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("trae_groups.cli")


def parse_size(text: str) -> int:
    """Bytes from "8388608", "512MiB", "1.5G", "64kb" (powers of 1024)."""
    from trae_groups.engine.config import parse_size as bytes_of

    try:
        return bytes_of(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tool_call_format(text: str) -> str:
    from trae_groups.engine.chat import TOOL_CALL_FORMATS

    if text not in TOOL_CALL_FORMATS:
        raise argparse.ArgumentTypeError(f"one of {', '.join(TOOL_CALL_FORMATS)}, not {text!r}")
    return text


def _port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free one), checked before anything loads."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0-65535")
    return port


def _seconds(text: str) -> float:
    """A finite, non-negative number of seconds (no nan, no inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds >= 0")
    return value


def _json_arg(text: str) -> Any:
    """JSON from the argument, or from a file with @path."""
    source = Path(text[1:]).read_text() if text.startswith("@") else text
    try:
        return json.loads(source)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None


def _print_json(data: Any) -> None:
    from trae_groups.serving.http_io import dumps  # strict JSON: NaN and infinities as null

    sys.stdout.write(dumps(data, indent=2) + "\n")


# ---------------------------------------------------------------- engine options


def _engine_options(parser: argparse.ArgumentParser) -> None:
    # the engine's own tables (engine/config.py imports no torch)
    from trae_groups.engine.config import (
        DEFAULT_STEP_TIME_TARGET_MS,
        ENGINE_DTYPES,
        KV_CACHE_DTYPES,
    )

    group = parser.add_argument_group("engine")
    group.add_argument("--pool-bytes", type=parse_size, help="memory pool size, e.g. 512MiB")
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cpu)")
    group.add_argument(
        "--dtype", default=None, choices=ENGINE_DTYPES,
        help="for models whose graph sets none; auto: bfloat16 where the hardware has bf16 "
        "matmuls (AVX512-BF16/AMX, or a GPU) and the accuracy gate allows it, else float32 "
        "(default: auto for trae serve, float32 elsewhere)",
    )  # fmt: skip
    group.add_argument("--attention-backend", default=None, help="torch, triton, flash_attn")
    group.add_argument(
        "--gpu-memory-reservation", type=float, default=None, metavar="SHARE",
        help="on a GPU, the share of its memory to fill; the pool takes it less what is in "
        "use once the weights are loaded (default: the graph's resources:, else 0.9)",
    )  # fmt: skip
    group.add_argument(
        "--weight-budget", type=parse_size, default=None,
        help="weights held at once, e.g. 2GiB: on-demand models are evicted to fit "
        "(default: the graph's resources:, else no limit)",
    )  # fmt: skip
    group.add_argument(
        "--step-time-target-ms", type=float, default=DEFAULT_STEP_TIME_TARGET_MS, metavar="MS",
        help="while requests stream, a step carries only the prompt tokens that keep it near "
        "MS milliseconds, by the model's measured step cost; 0: no limit (default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--speculative", default=None, metavar="METHOD[:K]",
        help="speculative decoding for every generate model whose graph sets none: ngram "
        "(prompt lookup), K tokens proposed per step (default: off; see docs/engine.md)",
    )  # fmt: skip
    group.add_argument(
        "--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
        help="what KV pages hold: auto (the model's dtype), int8, fp8 (CUDA 8.9+)",
    )  # fmt: skip


def _function_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-functions",
        metavar="PREFIXES",
        default=None,
        help="the only modules python nodes may name, comma-separated (sets "
        "$TRAE_ALLOWED_FUNCTIONS; default: any but the denied ones, see docs/graphs.md)",
    )


def _engine_config(args: argparse.Namespace):
    from trae_groups.engine.config import EngineConfig

    base = EngineConfig()
    changes = {
        "pool_bytes": args.pool_bytes,
        "device": args.device,
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "weight_budget": args.weight_budget,
        "gpu_memory_reservation": args.gpu_memory_reservation,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    if getattr(args, "speculative", None):
        from trae_groups.engine.spec_config import SpeculativeConfig

        try:
            changes["speculative"] = SpeculativeConfig.parse(args.speculative)
        except ValueError as exc:
            raise SystemExit(f"--speculative: {exc}") from None
    changes = {k: v for k, v in changes.items() if v is not None}
    # 0 turns the step-time target off (None in the config)
    changes["step_time_target_ms"] = args.step_time_target_ms or None
    return dataclasses.replace(base, **changes)


def _load_runtime(paths: Sequence[str], config) -> tuple[Any, list[Any]]:
    """Specs loaded, their models on one runtime, one executor per graph."""
    from trae_groups.graphs.loader import load_graph
    from trae_groups.graphs.runtime import ModelRuntime

    specs = [load_graph(p) for p in paths]
    runtime = ModelRuntime.for_specs(specs, config)
    executors = [runtime.bind(spec) for spec in specs]
    return runtime, executors


# ---------------------------------------------------------------- commands


def cmd_validate(args: argparse.Namespace) -> int:
    from trae_groups.graphs.errors import GraphValidationError
    from trae_groups.graphs.loader import load_graph
    from trae_groups.serving.buckets import histogram_buckets

    failed = False
    for path in args.graphs:
        try:
            spec = load_graph(path)
            histogram_buckets([spec])  # monitoring: names only the server knows
            issues = [] if args.skip_models else _missing_models(spec)
            if args.functions:
                from trae_groups.graphs.compile import resolve_functions

                resolve_functions(spec)
        except GraphValidationError as exc:
            issues = exc.issues
        if issues:
            failed = True
            for issue in issues:
                print(issue, file=sys.stderr)
            continue
        counts = f"{len(spec.nodes)} nodes, {len(spec.models)} models"
        print(f"ok: {path} (graph '{spec.name}': {counts})")
    return 1 if failed else 0


def _missing_models(spec) -> list:
    """Model folders that do not exist (or hold no config.json) and LoRA adapter folders
    without an adapter_config.json, located in the file."""
    from trae_groups.graphs.errors import SourceMap

    source = spec.source or SourceMap("<spec>")
    issues = []
    for name, model in spec.models.items():
        for version in model.sources:
            folder = spec.model_path(name, version)
            where = ("models", name, "source" if model.source else "versions")
            unset = _UNSET_VAR.findall(str(folder))
            if unset:  # expandvars leaves an unset variable as it is
                names = ", ".join(sorted({a or b for a, b in unset}))
                message = f"model '{name}': its folder {folder} needs {names}, which is not set"
                issues.append(source.issue(where, message))
            elif not (folder / "config.json").is_file():
                message = f"model '{name}': no model at {folder} (no config.json)"
                issues.append(source.issue(where, message))
        adapters = {**(model.adapters or {}), **model.version_adapters}
        for adapter, text in adapters.items():  # LoRA folders, located the same way
            folder = spec.adapter_path(text)
            key = "adapters" if adapter in (model.adapters or {}) else "versions"
            if not (folder / "adapter_config.json").is_file():
                message = f"model '{name}': no LoRA adapter at {folder} (no adapter_config.json)"
                issues.append(source.issue(("models", name, key, adapter), message))
    return issues


_UNSET_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def cmd_show(args: argparse.Namespace) -> int:
    from trae_groups import drawing
    from trae_groups.graphs.compile import compile_graph
    from trae_groups.graphs.loader import load_graph

    graph = compile_graph(load_graph(args.graph))
    fmt = args.format or ("png" if args.output and args.output.endswith(".png") else "text")
    if fmt == "png":
        if not args.output:
            print("error: --format png needs --output FILE.png", file=sys.stderr)
            return 2
        try:
            drawing.render_png(drawing.as_dot(graph), Path(args.output))
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.output}")
        return 0
    draw = {"text": drawing.as_text, "mermaid": drawing.as_mermaid, "dot": drawing.as_dot}
    text = draw[fmt](graph)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from trae_groups.engine.errors import ModelLoadError
    from trae_groups.graphs.errors import GraphError
    from trae_groups.graphs.loader import load_graph
    from trae_groups.serving.graph_api import result_body
    from trae_groups.serving.http_errors import error_body

    try:  # bad inputs fail before any model loads
        check_inputs(load_graph(args.graph), args.input)
    except ValueError as exc:
        _print_error(error_body(exc))
        return 1
    try:  # a missing or broken model folder: one line, not a traceback
        runtime, (executor,) = _load_runtime([args.graph], _engine_config(args))
    except (ModelLoadError, GraphError, ValueError) as exc:
        _print_error(error_body(exc))
        return 1
    outputs = args.outputs.split(",") if args.outputs else None
    runtime.start()
    try:
        if args.stream:
            return asyncio.run(_run_streamed(executor, args.input, outputs))
        result = asyncio.run(executor.run(args.input, outputs=outputs, timeout=args.timeout))
    except (GraphError, ValueError) as exc:
        _print_error(error_body(exc))
        return 1
    finally:
        runtime.shutdown()
    _print_json(result_body(result))
    return 0


def check_inputs(spec, inputs: Any) -> None:
    """The executor's input check, without loading models: InputError names the field."""
    from pydantic import ValidationError

    from trae_groups.graphs.executor import InputError

    if not isinstance(inputs, dict):
        raise InputError("(body)", "--input must be a JSON object")
    try:
        spec.input_model().model_validate(inputs)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InputError(
            ".".join(str(p) for p in first["loc"]) or "(inputs)", first["msg"]
        ) from None


async def _run_streamed(executor, inputs: dict, outputs) -> int:
    """Each event as one JSON line; the last one is the result or the error."""
    from trae_groups.serving.http_io import dumps

    status = 0
    async for event in executor.stream(inputs, outputs=outputs):
        sys.stdout.write(dumps({"event": event.type, **event.data}) + "\n")
        sys.stdout.flush()
        status = 1 if event.type == "error" else status
    return status


def _print_error(body: dict) -> None:
    sys.stderr.write(json.dumps(body, ensure_ascii=False) + "\n")


def cmd_model_info(args: argparse.Namespace) -> int:
    """What each model holds: every weight byte (packed and quantized copies too), how
    much of it is shared with another model and how much is a private copy."""
    config = dataclasses.replace(_engine_config(args), pool_bytes=args.pool_bytes or 4 << 20)
    runtime, executors = _load_runtime(args.graphs, config)
    try:
        reports = runtime.store.report()
        engine_stats = runtime.stats()
        on_demand = engine_stats.residency
        speculating = {  # speculative decoding: each model's setting and what it did
            name: {k: v for k, v in m.counters.items() if k.startswith("spec_")}
            for name, m in engine_stats.models.items() if "spec_num_tokens" in m.counters
        }  # fmt: skip
        adapters = runtime.adapter_report()
        users = _model_users(executors)
        follows = _follows_users(executors)
    finally:
        runtime.shutdown()
    rows = []
    for r in reports:
        row = {
            "name": r.name,
            "task": r.task,
            "parameters": r.parameters,
            "bytes": r.bytes,
            "shared_bytes": r.shared_bytes,
            "private_bytes": r.private_bytes,
            "device": r.device,
            "dtype": r.dtype,
            "resident": "always",
            "quantize": r.quantize,
        }
        if r.forward:  # a causal LM: our flat forward or transformers' (and why)
            row["forward"] = r.forward
        if any(x.choice for x in reports):  # "auto" weights: what was chosen and why
            row["chosen"] = r.choice
        if args.detail:
            row.update(path=r.path, memory=r.memory, gpu=r.gpu, loads=r.loads)
            row["used_by"] = users.get(r.name, [])
        rows.append(row)
    for name, stats in on_demand.items():  # not loaded: what its files say it will hold
        row = {"name": name, "task": "generate", "parameters": None, "bytes": stats.bytes,
               "shared_bytes": 0, "private_bytes": 0, "device": config.device,
               "dtype": config.dtype, "resident": "on_demand", "quantize": None}  # fmt: skip
        if args.detail:
            row["used_by"] = users.get(name, [])
        rows.append(row)
    for model, found in adapters.items():  # LoRA adapters: a row each, on their base
        for a in found:
            row = {"name": f"{model}:{a.name}", "task": f"lora r={a.rank}",
                   "parameters": a.parameters, "bytes": a.bytes, "shared_bytes": 0,
                   "private_bytes": a.bytes, "device": a.device, "dtype": a.dtype,
                   "resident": "always", "quantize": None}  # fmt: skip
            if args.detail:
                row.update(path=a.path, memory="-", gpu="-", loads=1)
                row["used_by"] = users.get(model, [])
            rows.append(row)
    held = runtime.store.total_bytes()
    adapter_bytes = sum(a.bytes for found in adapters.values() for a in found)
    if args.json:
        _print_json({"models": rows, "held_bytes": held, "adapter_bytes": adapter_bytes,
                     "speculative": speculating, "follows": follows})  # fmt: skip
        return 0
    _print_table(rows)
    naive = sum(r.bytes for r in reports)
    print(f"held once: {_mib(held)} (without sharing: {_mib(naive)})")
    if on_demand:
        print("on-demand models load at their first request: bytes are estimates from files")
    if adapter_bytes:
        print(f"LoRA adapters: {_mib(adapter_bytes)} (in slots when requests use them)")
    for name, c in speculating.items():
        print(
            f"speculative decoding: {name}: up to {c['spec_num_tokens']:g} tokens a step, "
            f"accepted {c['spec_accepted_tokens']:g} of {c['spec_proposed_tokens']:g} proposed "
            f"({c['spec_acceptance_rate']:.0%}), {c['spec_drafting_seconds']:.3f} s drafting"
        )
    for name, found in follows.items():
        for f in found:
            print(
                f"speculative decoding: {name}: {f['node']} drafts from the text of "
                f"{f['drafts_from']} (follows, up to {f['num_tokens']} tokens a step)"
            )
    return 0


def _follows_users(executors) -> dict[str, list[dict[str, Any]]]:
    """Model name -> the generate nodes that draft from another node's text on it
    (``speculative: {method: follows}``). A model set for no speculation gets its
    speculator at the first request of one of them, so the engine's counters cannot show
    it before then: the graphs say it."""
    found: dict[str, list[dict[str, Any]]] = {}
    for executor in executors:
        graph, name = executor.graph, executor.graph.spec.name
        for node, source in graph.references.items():
            declared = graph.spec.nodes[node]
            entry = {"node": f"{name}/{node}", "drafts_from": f"{name}/{source}",
                     "num_tokens": declared.speculative.num_tokens}  # fmt: skip
            found.setdefault(declared.model, []).append(entry)
    return found


def _model_users(executors) -> dict[str, list[str]]:
    """Model name -> the graph/node pairs that run on it."""
    users: dict[str, list[str]] = {}
    for executor in executors:
        spec = executor.graph.spec
        for node_name, node in spec.nodes.items():
            model = getattr(node, "model", None)
            if model:
                users.setdefault(model, []).append(f"{spec.name}/{node_name}")
    return users


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _print_table(rows: list[dict]) -> None:
    if not rows:
        print("(no models)")
        return
    cells = [[_cell(k, v) for k, v in row.items()] for row in rows]
    heads = list(rows[0])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    print("  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _cell(key: str, value: Any) -> str:
    if key.endswith("bytes") and isinstance(value, int):
        return _mib(value)
    if isinstance(value, list):
        return ",".join(value) or "-"
    if value is None:
        return "-"
    return str(value)


def _admin(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> int:
    """One admin call to a running server; prints the answer (JSON), exit 1 on an error."""
    import httpx

    token = args.token or os.environ.get("TRAE_ADMIN_TOKEN", "")
    try:
        with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
            graph = _graph_of(client, args)
            if graph is None:
                return 1
            response = client.request(
                method, path.format(graph=graph, model=args.model), json=body,
                headers={"Authorization": f"Bearer {token}"},
            )  # fmt: skip
    except httpx.TransportError as exc:  # server down, refused, timed out: one line
        print(f"error: cannot reach {args.url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        _print_error(response.json())
        return 1
    _print_json(response.json())
    return 0


def _graph_of(client, args: argparse.Namespace) -> str | None:
    """--graph (a name or a YAML file), else the one served graph that has the model."""
    graph = args.graph
    if graph and graph.endswith((".yaml", ".yml")) and Path(graph).is_file():
        from trae_groups.graphs.loader import load_graph

        return load_graph(graph).name
    if graph:
        return graph
    served = client.get("/v1/graphs").json().get("graphs", [])
    having = [g["name"] for g in served if args.model in g.get("models", [])]
    if len(having) != 1:
        where = f"graphs {having}" if having else "no served graph"
        _print_error(
            {
                "error": {
                    "type": "NotFound",
                    "message": f"model '{args.model}' is in {where}: pass --graph",
                }
            }
        )
        return None
    return having[0]


def cmd_model_route(args: argparse.Namespace) -> int:
    """Show, or change, a model's split between its versions on a running server."""
    path = "/admin/graphs/{graph}/models/{model}/route"
    if args.split is not None:
        return _admin(args, "POST", path, {"split": args.split})
    if args.version is not None:
        if args.weight is None:
            _print_error({"error": {"type": "BadRequest", "message": "--version needs --weight"}})
            return 1
        return _admin(args, "POST", path, {"version": args.version, "weight": args.weight})
    return _admin(args, "GET", path)


def cmd_model_upload(args: argparse.Namespace) -> int:
    """Load a new version on a running server (0% of traffic until routed): a model
    folder (--path) or a LoRA adapter on the model's base (--adapter)."""
    field = "adapter" if args.adapter is not None else "path"
    path = str(Path(getattr(args, field)).expanduser().resolve())
    body = {"version": args.version, field: path}
    return _admin(args, "POST", "/admin/graphs/{graph}/models/{model}/versions", body)


def cmd_model_unload(args: argparse.Namespace) -> int:
    """Unload a version that no route uses; its memory is freed."""
    return _admin(args, "DELETE", "/admin/graphs/{graph}/models/{model}/versions/" + args.version)


def cmd_health(args: argparse.Namespace) -> int:
    import httpx

    report: dict[str, Any] = {"url": args.url}
    try:
        with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
            report["alive"] = client.get("/health").status_code == 200
            ready = client.get("/ready")
            report["ready"] = ready.status_code == 200
            if not report["ready"]:
                report["reason"] = ready.json().get("error", {}).get("message")
    except httpx.HTTPError as exc:
        report.update(alive=False, ready=False, reason=f"{type(exc).__name__}: {exc}")
    _print_json(report)
    return 0 if report["ready"] else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from trae_groups.serving.server import ServerConfig, serve

    try:  # a flag's value out of range is a usage error, not a traceback
        config = ServerConfig(
            host=args.host,
            port=args.port,
            engine=_engine_config(args),
            max_inflight=args.max_inflight,
            max_body_bytes=args.max_body_bytes,
            shutdown_grace_s=args.grace,
            admin_token=args.admin_token,
            log_level=args.log_level,
            access_log=args.access_log,
            freeze_gc=args.gc_freeze,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_s=args.keep_alive,
            max_connections=args.max_connections or None,
            openai_timeout_s=args.openai_timeout,
            tool_call_parser=args.tool_call_parser,
            memory_profile=args.memory_profile,
            memory_profile_interval_s=args.memory_interval,
            engine_process=args.engine_process,
            api_workers=args.api_workers,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.otlp_endpoint:  # every front process reads it (graphs/tracing.configure_from_env)
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.otlp_endpoint
    if args.ray_config:
        import yaml

        from trae_groups.cluster.app import serve_config

        print(yaml.safe_dump(serve_config(args.graphs, args.host, args.port), sort_keys=False))
        return 0
    if args.ray is not None:
        from trae_groups.cluster.app import run

        config = dataclasses.replace(config, engine_process=False, api_workers=1)  # Serve's own
        return run(args.graphs, address=args.ray or None, host=args.host, port=args.port,
                   engine=config.engine, server=config)  # fmt: skip
    return serve(args.graphs, config)


def cmd_profile_plot(args: argparse.Namespace) -> int:
    from trae_groups.monitor import plot_profile

    try:
        out = plot_profile(args.profile, args.output)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from trae_groups.demo.run import run_demo

    return run_demo(args.host, args.port, example=not args.no_example)


def cmd_bench(args: argparse.Namespace) -> int:
    from trae_groups import loadgen
    from trae_groups.graphs.loader import load_graph

    spec = load_graph(args.graph)
    inputs = args.input if args.input is not None else loadgen.sample_inputs(spec)
    load = loadgen.Load(args.clients, args.requests)
    if args.url:
        report = asyncio.run(loadgen.over_http(load, args.url, spec.name, inputs, args.timeout))
    else:
        from trae_groups.graphs.runtime import settle_heap

        runtime, (executor,) = _load_runtime([args.graph], _engine_config(args))
        runtime.start()
        settle_heap()  # as trae serve does: no full-collection pauses in the measurement
        try:
            report = asyncio.run(loadgen.in_process(load, executor, inputs))
        finally:
            runtime.shutdown()
            gc.unfreeze()
    if args.json:
        _print_json(report)
    else:
        print(
            f"{report['graph']} ({report['target']}): {report['requests']} requests, "
            f"{report['errors']} errors, {args.clients} clients in {report['seconds']:.2f} s\n"
            f"throughput {report['throughput_rps']:.2f} req/s, latency p50 "
            f"{report['p50_ms']:.1f} ms, p99 {report['p99_ms']:.1f} ms"
        )
        if report["first_error"]:
            print(f"first error: {report['first_error']}", file=sys.stderr)
    return 0 if not report["errors"] else 1


# ---------------------------------------------------------------- the parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trae", description="Serve composite model apps.")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve graphs over HTTP")
    serve.add_argument("graphs", nargs="+", metavar="GRAPH.yaml")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--max-inflight", type=int, default=256, help="per graph; 429 beyond")
    serve.add_argument("--max-body-bytes", type=parse_size, default=1 << 20)
    serve.add_argument("--grace", type=_seconds, default=30.0, help="seconds to drain on exit")
    serve.add_argument("--admin-token", default=None, help="default: $TRAE_ADMIN_TOKEN")
    serve.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds for a request's headers"
    )
    serve.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds for a body, after its headers"
    )
    serve.add_argument(
        "--keep-alive", type=float, default=5.0, help="seconds an idle connection stays open"
    )
    serve.add_argument(
        "--max-connections", type=int, default=1024, help="503 beyond this many (0: no cap)"
    )
    serve.add_argument(
        "--openai-timeout", type=float, default=300.0,
        help="seconds an OpenAI request may take before a 504 (graphs: their own timeout)",
    )  # fmt: skip
    serve.add_argument(
        "--tool-call-parser", type=_tool_call_format, default=None,
        help="hermes, llama3, mistral or json: how replies write tool calls (OpenAI routes) "
        "where a graph's model does not say; default: read from each model's chat template",
    )  # fmt: skip
    serve.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="no log line per request (about 15%% more requests/s on small graphs)",
    )
    serve.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="leave the loaded models in the garbage collector's full passes "
        "(by default they are frozen out of them: 100-300 ms pauses otherwise)",
    )
    serve.add_argument(
        "--memory-profile", metavar="FILE", default=None,
        help="sample memory (process, device, pool pages by owner, weights per model) into "
        "FILE, one JSON line per sample; draw it with `trae profile plot FILE -o mem.png`",
    )  # fmt: skip
    serve.add_argument(
        "--memory-interval", type=float, default=1.0, help="seconds between memory samples"
    )
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine (models, pool, loop, scheduler) in a child process of its own, "
        "restarted if it dies; --no-engine-process keeps it in the HTTP process",
    )
    serve.add_argument(
        "--otlp-endpoint", default=None, metavar="URL",
        help="send OpenTelemetry traces (a span per graph request, a child per node) over "
        "OTLP/HTTP to URL (e.g. http://127.0.0.1:4318; sets OTEL_EXPORTER_OTLP_ENDPOINT); "
        "off by default; needs trae-groups[otel]",
    )  # fmt: skip
    serve.add_argument(
        "--api-workers", type=int, default=1, metavar="N",
        help="HTTP front processes sharing the one engine process (default 1); admin "
        "changes need 1",
    )  # fmt: skip
    serve.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="serve on a Ray cluster: engine groups as Serve deployments (graph's deploy: "
        "section); ADDRESS joins an existing cluster ('auto', 'ray://...'), none starts one",
    )
    serve.add_argument(
        "--ray-config",
        action="store_true",
        help="print the Serve config equivalent to --ray (for `serve deploy`) and exit",
    )
    _function_options(serve)
    _engine_options(serve)
    serve.set_defaults(run=cmd_serve, dtype="auto")  # serving: what the hardware runs fast

    demo = sub.add_parser("demo", help="prepare and serve the embedded support demo")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=_port, default=8000)
    demo.add_argument("--no-example", action="store_true", help="do not send the example request")
    demo.set_defaults(run=cmd_demo)

    run = sub.add_parser("run", help="run a graph once in this process; print the result")
    run.add_argument("graph", metavar="GRAPH.yaml")
    run.add_argument("--input", type=_json_arg, default={}, help="JSON object, or @file.json")
    run.add_argument("--outputs", help="comma-separated outputs (default: all)")
    run.add_argument("--timeout", type=float, default=None)
    run.add_argument("--stream", action="store_true", help="print events as JSON lines")
    _function_options(run)
    _engine_options(run)
    run.set_defaults(run=cmd_run)

    validate = sub.add_parser("validate", help="check graph files; exit 1 when invalid")
    validate.add_argument("graphs", nargs="+", metavar="GRAPH.yaml")
    validate.add_argument("--skip-models", action="store_true", help="do not check model folders")
    validate.add_argument(
        "--functions", action="store_true", help="also import python nodes' functions"
    )
    _function_options(validate)
    validate.set_defaults(run=cmd_validate)

    show = sub.add_parser("show", help="draw the DAG")
    show.add_argument("graph", metavar="GRAPH.yaml")
    show.add_argument("--format", choices=["text", "mermaid", "dot", "png"])
    show.add_argument("--output", "-o", help="write to a file (png needs Graphviz)")
    show.set_defaults(run=cmd_show)

    model = sub.add_parser("model", help="model commands")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    info = model_sub.add_parser("info", help="the weight-sharing report")
    info.add_argument("graphs", nargs="+", metavar="GRAPH.yaml")
    info.add_argument("--detail", action="store_true", help="paths, policies, users")
    info.add_argument("--json", action="store_true")
    _engine_options(info)
    info.set_defaults(run=cmd_model_info)

    def admin_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", help="the model's name in its graph")
        p.add_argument(
            "--graph", default=None, help="graph name or YAML file (default: the one with MODEL)"
        )
        p.add_argument("--url", default="http://127.0.0.1:8000")
        p.add_argument("--token", default=None, help="default: $TRAE_ADMIN_TOKEN")
        p.add_argument("--timeout", type=float, default=300.0)

    route = model_sub.add_parser("route", help="show or set a model's split between versions")
    admin_options(route)
    route.add_argument("--split", help='e.g. "v1:90%%, v2:10%%"')
    route.add_argument("--version", help="with --weight: give one version this share")
    route.add_argument("--weight", help='e.g. "100%%" (the others keep their proportions)')
    route.set_defaults(run=cmd_model_route)

    upload = model_sub.add_parser("upload", help="load a new version on a running server")
    admin_options(upload)
    upload.add_argument("--version", required=True)
    source = upload.add_mutually_exclusive_group(required=True)
    source.add_argument("--path", help="the version's model folder")
    source.add_argument("--adapter", help="a PEFT LoRA folder: the version runs on the base")
    upload.set_defaults(run=cmd_model_upload)

    unload = model_sub.add_parser("unload", help="unload a version no route uses")
    admin_options(unload)
    unload.add_argument("--version", required=True)
    unload.set_defaults(run=cmd_model_unload)

    profile = sub.add_parser("profile", help="memory profiles (trae serve --memory-profile)")
    profile_sub = profile.add_subparsers(dest="profile_command", required=True)
    plot = profile_sub.add_parser("plot", help="draw a memory profile as a stacked area chart")
    plot.add_argument("profile", metavar="FILE")
    plot.add_argument("--output", "-o", default="mem.png", help="the PNG to write")
    plot.set_defaults(run=cmd_profile_plot)

    health = sub.add_parser("health", help="is a server alive and ready? (exit 0 if ready)")
    health.add_argument("--url", default="http://127.0.0.1:8000")
    health.add_argument("--timeout", type=float, default=5.0)
    health.set_defaults(run=cmd_health)

    bench = sub.add_parser("bench", help="throughput and latency of a graph")
    bench.add_argument("graph", metavar="GRAPH.yaml")
    bench.add_argument("--clients", type=int, default=8)
    bench.add_argument("--requests", type=int, default=100)
    bench.add_argument("--url", help="a running server (default: in-process)")
    bench.add_argument("--input", type=_json_arg, default=None, help="default: sample inputs")
    bench.add_argument("--timeout", type=float, default=120.0)
    bench.add_argument("--json", action="store_true")
    _function_options(bench)
    _engine_options(bench)
    bench.set_defaults(run=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if getattr(args, "clients", 1) < 1 or getattr(args, "requests", 1) < 0:
        print("error: --clients must be >= 1 and --requests >= 0", file=sys.stderr)
        return 2
    from trae_groups.engine.errors import ModelLoadError
    from trae_groups.graphs.errors import GraphValidationError
    from trae_groups.graphs.functions import ENV_VAR

    if getattr(args, "allow_functions", None) is not None:  # one home: the variable
        os.environ[ENV_VAR] = args.allow_functions
    try:
        return args.run(args)
    except GraphValidationError as exc:
        print(exc, file=sys.stderr)
        return 1
    except (FileNotFoundError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
