"""The ``psgrad`` command: the client's commands, and the server's through the
``psgrad.commands`` entry points when the server is installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import service.cli
from psgrad import _cli


def test_the_server_adds_its_commands_through_the_entry_point() -> None:
    assert service.cli in _cli.plugins()  # psgrad-server's entry point (installed here)
    parser = _cli.build_parser([service.cli])
    for words in (["serve"], ["worker"], ["models", "list"], ["dp", "list"]):
        assert parser.parse_args(words).command == words[0]
    assert parser.parse_args(["serve"]).plugin is service.cli


def test_a_client_alone_says_where_serve_comes_from(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_cli, "plugins", list)  # no server installed
    for command in ("serve", "worker"):
        assert _cli.main([command, "--port", "8000"]) == 2
        err = capsys.readouterr().err
        assert f"'{command}' is a command of the server" in err and "./client ." in err
    with pytest.raises(SystemExit):  # the client's commands are still there
        _cli.main(["models", "--help"])
    assert "list" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["models", "upload", "m", "{file}"],
                                     ["models", "register", "m", "--architecture", "mlp",
                                      "--weights", "{file}"]])
def test_a_weights_file_that_is_not_safetensors_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    """``torch.save`` files (a pickle in a zip) are never read: one line says how to write the
    weights, no traceback, and nothing is sent (the server's address is never reached)."""
    saved = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, saved)
    with pytest.raises(SystemExit) as stopped:
        _cli.main([w.format(file=saved) for w in command] + ["--url", "http://127.0.0.1:9"])
    message = str(stopped.value)
    assert message.startswith("psgrad: error: ") and "\n" not in message
    assert "is not a safetensors file" in message and "save_file" in message
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("given", ["directory", "missing"])
def test_a_weights_path_that_is_no_file_is_named_in_one_line(tmp_path: Path, given: str) -> None:
    """A directory (safetensors said "No such device (os error 19)") or a missing path: the
    line names the path and what it is."""
    path = tmp_path if given == "directory" else tmp_path / "nowhere.safetensors"
    with pytest.raises(SystemExit) as stopped:
        _cli.main(["models", "upload", "m", str(path), "--url", "http://127.0.0.1:9"])
    message = str(stopped.value)
    assert message.startswith(f"psgrad: error: {path} is ") and "\n" not in message
    assert ("a directory" if given == "directory" else "not found") in message
