"""The ``psgrad`` command: the client's commands, and the server's through the
``psgrad.commands`` entry points when the server is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import service.cli
from psgrad import _cli
from service.api import create_app
from tests.support.api import serving, settings


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


def _one_line(capsys: pytest.CaptureFixture[str], code: int, *words: str) -> None:
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("psgrad: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and all(w in err for w in words), err


def test_a_file_that_is_no_safetensors_or_json_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What a user points the commands at, read wrongly, is one line and exit 1: a corrupt
    .safetensors input, a --config that is JSON but no object; an @file that does not exist
    is argparse's usage error. Nothing reaches the (absent) server."""
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\xff" * 64)
    off = ["--url", "http://127.0.0.1:9"]
    _one_line(capsys, _cli.main(["grads", "m", "--inputs", str(bad), "-o",
                                 str(tmp_path / "o.safetensors"), *off]),
              f"{bad} is not a safetensors file numpy can read")
    for flag, value, said in (("--config", "[1, 2]", "'config' must be a JSON object"),
                              ("--input", "[4]", "'input' must be a JSON object")):
        args = ["models", "register", "m", "--architecture", "mlp", flag, value, *off]
        _one_line(capsys, _cli.main(args), said)
    with pytest.raises(SystemExit) as stopped:
        _cli.main(["models", "register", "m", "--architecture", "mlp", "--config",
                   f"@{tmp_path / 'missing.json'}", *off])
    assert stopped.value.code == 2 and "cannot read" in capsys.readouterr().err
    for args, said in ((["models", "list", "--url", "127.0.0.1:9"], "must be http://host"),
                       (["models", "list", "--api-key", "k1\n", *off], "strip a key"),
                       (["models", "list", "--timeout", "-5", *off], "timeout must be")):
        _one_line(capsys, _cli.main(args), said)


def _cli_process(*args: str) -> subprocess.CompletedProcess[str]:
    """``psgrad`` as its own process: a command that talks to a server in this process runs
    apart from pytest's captured streams (a server's logging must not hold those)."""
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True,
                          text=True, timeout=240, cwd=Path(__file__).resolve().parents[2])


def _one_line_of(done: subprocess.CompletedProcess[str], *words: str) -> None:
    err = done.stderr
    assert done.returncode == 1 and err.startswith("psgrad: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err and all(w in err for w in words), err


def test_a_download_to_a_path_it_cannot_write_is_one_line(tmp_path: Path) -> None:
    target = tmp_path / "no" / "w.safetensors"
    with serving(create_app(settings(workers=1))) as url:
        done = _cli_process("models", "download", "mlp", str(target), "--url", url)
    _one_line_of(done, "cannot write", str(target))


def test_serve_refuses_a_port_or_setting_it_cannot_use_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--port 99999 was served on 99999 mod 65536; PSGRAD_WORKERS=abc was pydantic's report
    as a traceback. Both are refused before anything starts, each setting on a line."""
    with pytest.raises(SystemExit) as stopped:
        _cli.main(["serve", "--port", "99999"])
    assert stopped.value.code == 2
    assert "a port is a number from 1 to 65535; got '99999'" in capsys.readouterr().err
    from service.config import get_settings

    monkeypatch.setenv("PSGRAD_WORKERS", "abc")
    monkeypatch.setenv("PSGRAD_LISTEN_PORT", "70000")
    get_settings.cache_clear()
    try:
        assert service.cli.main(["serve"]) == 2
    finally:
        get_settings.cache_clear()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[2].strip() for line in lines] == ["PSGRAD_WORKERS",
                                                              "PSGRAD_LISTEN_PORT"], lines
    assert all(line.startswith("psgrad: error: PSGRAD_") for line in lines), lines


def test_grads_reads_its_files_as_its_help_says(tmp_path: Path) -> None:
    """The targets default to the tensor 'targets' of a safetensors inputs file, named with
    ':inputs' or not (with it they were lost: 'targets' is required); a .npy file holds one
    array, so ':NAME' after it is refused, not dropped; a file that is no .npy of numbers
    says so (it read as a pickle refused)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 784)).astype(np.float32)
    save_file({"inputs": x, "targets": np.array([1, 2])}, str(tmp_path / "xy.safetensors"))
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "junk.npy").write_bytes(b"\x00junk" * 20)
    out = tmp_path / "o.safetensors"
    with serving(create_app(settings(workers=1))) as url:
        for spec in ("xy.safetensors", "xy.safetensors:inputs"):
            done = _cli_process("grads", "mlp", "--inputs", str(tmp_path / spec), "--outputs",
                                "norms", "-o", str(out), "--url", url)
            assert done.returncode == 0 and "2 samples, norms" in done.stderr, done.stderr
        off = ["-o", str(out), "--url", url]
        _one_line_of(_cli_process("grads", "mlp", "--inputs", f"{tmp_path / 'x.npy'}:x", *off),
                     "holds one array: name it without ':x'")
        _one_line_of(_cli_process("grads", "mlp", "--inputs", str(tmp_path / "junk.npy"), *off),
                     "is not a .npy file of numbers")
