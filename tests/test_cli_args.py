"""The CLI's argument checks and its answer when a server is down: one line, never a
traceback (in this process, through ``main``, as the ``trae`` command runs it)."""

from __future__ import annotations

import socket

import pytest

from trae_groups.cli import main


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--port", "99999", "outside 0-65535"),
        ("--port", "-5", "outside 0-65535"),
        ("--port", "http", "not a port number"),
        ("--grace", "nan", "finite number of seconds"),
        ("--grace", "inf", "finite number of seconds"),
        ("--grace", "-1", "finite number of seconds"),
        ("--tool-call-parser", "xml", "one of hermes, llama3, mistral, json"),
    ],
)
def test_bad_ports_and_graces_are_usage_errors(tmp_path, capsys, flag, value, says):
    graph = tmp_path / "g.yaml"  # never read: argparse refuses first
    with pytest.raises(SystemExit) as exited:
        main(["serve", str(graph), flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert flag in line and says in line


def test_demo_checks_its_port_too(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--port", "70000"])
    assert exited.value.code == 2
    assert "outside 0-65535" in capsys.readouterr().err


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]  # closed when this returns: nothing listens there


@pytest.mark.parametrize(
    "command",
    [
        ["model", "route", "dialog"],
        ["model", "route", "dialog", "--graph", "chat", "--split", "v1:100%"],
        ["model", "unload", "dialog", "--version", "v2"],
    ],
)
def test_admin_commands_against_a_server_that_is_down_say_so_in_one_line(capsys, command):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main([*command, "--url", url, "--timeout", "5"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach {url}: ConnectError")


def test_the_tool_call_parser_flag_reaches_the_server_config():
    from trae_groups.cli import build_parser
    from trae_groups.serving.server import ServerConfig

    args = build_parser().parse_args(["serve", "g.yaml", "--tool-call-parser", "llama3"])
    assert args.tool_call_parser == "llama3"
    assert build_parser().parse_args(["serve", "g.yaml"]).tool_call_parser is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="xml")
