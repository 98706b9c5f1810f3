"""The command line's own behaviour: version, argument errors before any work, errors without tracebacks."""

from __future__ import annotations

import pytest

import pic
from pic.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"pic {pic.__version__}"


@pytest.mark.parametrize("value", ["-5", "many"])
def test_bad_token_count_is_refused_before_any_work(capsys, value):
    with pytest.raises(SystemExit) as done:
        main(["demo", "--max-new-tokens", value])
    captured = capsys.readouterr()
    assert done.value.code == 2 and captured.out == ""  # no header printed before the error
    assert "--max-new-tokens" in captured.err


def test_demo_refuses_a_bad_max_new_tokens_before_loading(monkeypatch):
    from pic import demo

    monkeypatch.setattr(demo.PIC, "from_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(pic.InvalidInputError, match="max_new_tokens=-5"):
        demo.run_demo(max_new_tokens=-5)


@pytest.mark.parametrize("device", ["cuda:99", "gpu"])
def test_unavailable_device_is_an_error_message_not_a_traceback(capsys, device):
    assert main(["demo", "--device", device]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"pic: error: device '{device}'")
    assert "Traceback" not in captured.err


def test_missing_model_is_an_error_message(capsys):
    assert main(["demo", "--model", "/nonexistent/model"]) == 1
    assert capsys.readouterr().err.strip() == "pic: error: cannot load model '/nonexistent/model': no such folder"
