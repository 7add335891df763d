"""Operations commands: the health probe the Docker HEALTHCHECK runs, JSON logs."""

from __future__ import annotations

import json
import logging

from duelq.apps.cli import main, setup_logging
from duelq.server.server import LearnerServer, ServerOptions


def test_health_probe_exit_codes(server, dead_target, capsys):
    assert main(["health", "--target", server.target]) == 0
    assert capsys.readouterr().out.strip().endswith("SERVING")
    assert main(["health", "--target", dead_target, "--timeout", "1"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().out


def test_health_probe_says_not_serving_before_the_backend_is_attached(capsys):
    starting = LearnerServer(ServerOptions(port=0))
    starting.start()
    try:
        assert main(["health", "--target", starting.target]) == 1
        assert capsys.readouterr().out.strip().endswith("NOT_SERVING")
    finally:
        starting.stop(0)


def test_json_log_lines(capsys):
    setup_logging("INFO", "json")
    logging.getLogger("duelq.test").info("hello %s", "world")
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["message"] == "hello world"
    assert line["level"] == "INFO" and line["name"] == "duelq.test" and "time" in line
    assert "process" not in line
    setup_logging("INFO", "json", role="learner")   # --front-processes' learner process
    logging.getLogger("duelq.test").info("tagged")
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["process"] == "learner"
    setup_logging("INFO", "text", role="learner")
    logging.getLogger("duelq.test").info("tagged")
    assert "duelq.test [learner]: tagged" in capsys.readouterr().err
    setup_logging("WARNING", "text")
