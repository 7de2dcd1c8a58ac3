"""hethub's messages go through logging (hethub.messages): one line each on stderr as "hethub
COMMAND: message", -q keeps warnings and errors only, -v adds debug lines, and a user's own
handler on the "hethub" logger receives them; an error stays one line, exit status 2."""

from __future__ import annotations

import logging

import pytest

from hethub.cli import main
from hethub.messages import logger, set_verbosity


@pytest.fixture(autouse=True)
def _default_verbosity():
    yield
    set_verbosity(0)


def test_a_message_is_one_line_named_for_its_command(capsys) -> None:
    logger("train").info("step 1/2: loss 4.2")
    logger().warning("warning: stale profiles")
    assert capsys.readouterr().err.splitlines() == [
        "hethub train: step 1/2: loss 4.2",
        "hethub: warning: stale profiles",
    ]


def test_quiet_keeps_warnings_and_errors_and_verbose_adds_debug(capsys) -> None:
    set_verbosity(-1)
    logger("profile").info("measuring")
    logger("profile").warning("warning: noisy")
    set_verbosity(1)
    logger("profile").debug("a detail")
    assert capsys.readouterr().err.splitlines() == [
        "hethub profile: warning: noisy",
        "hethub profile: a detail",
    ]


def test_a_users_handler_receives_hethubs_messages() -> None:
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    keep = Keep()
    logging.getLogger("hethub").addHandler(keep)
    try:
        logger("validate").info("prediction within 25%")
    finally:
        logging.getLogger("hethub").removeHandler(keep)
    assert [(r.name, r.getMessage()) for r in seen] == [
        ("hethub.validate", "prediction within 25%")
    ]


def test_every_command_takes_q_and_v_but_not_both_and_an_error_stays_one_line(
    tmp_path, capsys
) -> None:
    missing = str(tmp_path / "none.yaml")
    code = main(["predict", "-q", "--cluster", missing, "--model", "tiny-llama"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("hethub predict: error: ")
    assert main(["catalog", "-q", "-v"]) == 2
    refused = capsys.readouterr().err.splitlines()
    assert refused == [
        "hethub catalog: error: argument -v/--verbose: not allowed with argument -q/--quiet"
    ]
