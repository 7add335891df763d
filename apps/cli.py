"""The ``duelq`` command: ``serve`` runs a learner server, ``demo`` shows one train,
``health`` probes a server, ``bench`` measures one.

Every flag can also be set by an environment variable ``DUELQ_<FLAG>`` (for
``--max-streams``: ``DUELQ_MAX_STREAMS``); a flag on the command line wins.
The LearnerConfig and ServerOptions flags are generated from those dataclasses,
with their field docstrings as help, so a new knob becomes a flag by itself.

Only ``health`` runs on the client install; the other commands need extras, and
say which (with the pip command) in one line when one is missing.  Of the server, only
its logging setup (the standard library alone) is imported at import; the rest when a
command needs it.

Exit codes: 0 success (also a clean shutdown on SIGINT/SIGTERM), 1 a runtime
failure (cannot bind, no usable backend, the final checkpoint could not be
written, the demo failed, a missing extra), 2 a usage or configuration error (a
replay buffer too large for its device included), 3 the newest checkpoint in
``--checkpoint-dir`` is unreadable, corrupt or of other shapes (a setting outside
checkpoint.TUNABLE_FIELDS differs; ``duelq serve`` never starts fresh over it), 130 the
demo stopped by Ctrl-C (after its partial summary).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import re
import signal
import sys
import textwrap
import threading
from typing import Any, Callable, Sequence
from urllib.parse import unquote, urlparse

from duelq.server.logs import setup_logging

log = logging.getLogger("duelq")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_CHECKPOINT = 0, 1, 2, 3
EXIT_INTERRUPTED = 130   # Ctrl-C, as a shell's
ENV_PREFIX = "DUELQ_"
COMMANDS = ("serve", "demo", "health", "bench")
#: The modules each extra of the distribution brings.
EXTRA_MODULES = {"server": ("grpc_reflection", "safetensors", "prometheus_client",
                            "pythonjsonlogger"),
                 "demo": ("tqdm", "matplotlib", "gymnasium")}
#: Of those, the ones each command imports (the demo's gymnasium only with --env).
COMMAND_NEEDS = {"serve": {"server": EXTRA_MODULES["server"]},
                 "demo": {"server": EXTRA_MODULES["server"], "demo": ("tqdm", "matplotlib")},
                 "bench": {"server": EXTRA_MODULES["server"], "demo": ("tqdm", "matplotlib")},
                 "health": {}}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
SECRETS = {"token"}  # never echoed in --help; prefer DUELQ_TOKEN or --token-file to --token


class UsageError(Exception):
    """A flag or environment variable has a value that cannot be used."""


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def field_docs(cls: type, code: str = "") -> dict[str, str]:
    """The help of each field of a dataclass, by field name: its docstring, with the
    fields it names (``tls_key``, checkpoint_every_*) named by their flags, and ``code``
    (markdown's ` for the README's tables) around those and the docstring's literals."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    names = {f.name for f in dataclasses.fields(cls)}

    def flag(match: re.Match) -> str:
        name, star = match["name"], match["star"]
        if star and any(n.startswith(name + "_") for n in names):
            return code + flag_name(name) + "-*" + code
        named = name in names and (match["quoted"] or "_" in name)
        return code + flag_name(name) + code if named else match[0]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            doc = " ".join(after.value.value.split())
            doc = re.sub(r"(?P<quoted>``)?\b(?P<name>[a-z][a-z0-9_]*?)"
                         r"(?:(?P<star>_\*)|(?![a-z0-9_]))(?(quoted)``)", flag, doc)
            docs[node.target.id] = doc.replace("``", code)
    return docs


def parse_bool(text: str) -> bool:
    if text.lower() in TRUE:
        return True
    if text.lower() in FALSE:
        return False
    raise ValueError(f"expected one of {TRUE + FALSE}")


def parse_slots(text: str) -> dict[str, int]:
    """``name=index,name=index`` → {name: index}."""
    slots = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, index = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} is not name=index")
        slots[name.strip()] = int(index)
    return slots


_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": int, "float": float, "str": str, "bool": parse_bool, "Mapping[str, int]": parse_slots,
}


def add_flag(group, dest: str, kind: str, default: Any, help: str, **extra) -> None:
    """A flag whose default comes from ``DUELQ_<DEST>`` when that is set."""
    parse = _PARSERS[kind]
    env = env_name(dest)
    if env in os.environ:
        try:
            default = parse(os.environ[env])
        except ValueError as exc:
            raise UsageError(f"{env}={os.environ[env]!r}: {exc}") from None
        if "choices" in extra and default not in extra["choices"]:
            raise UsageError(f"{env}={default!r}: must be one of {extra['choices']}")
    if dest in SECRETS or default in ("", None):
        shown = ""
    elif kind.startswith("Mapping"):
        shown = "default " + ",".join(f"{k}={v}" for k, v in default.items()) + "; "
    else:
        shown = f"default {default}; "
    help = f"{help} [{shown}env {env}]".replace("%", "%%")
    if kind == "bool":
        group.add_argument(flag_name(dest), dest=dest, default=default, help=help,
                           action=argparse.BooleanOptionalAction)
    else:
        group.add_argument(flag_name(dest), dest=dest, default=default, help=help,
                           type=parse, metavar=None if "choices" in extra else dest.upper(),
                           **extra)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, title: str,
                        defaults: dict[str, Any] | None = None) -> None:
    group = parser.add_argument_group(title)
    docs = field_docs(cls)
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        add_flag(group, f.name, str(f.type), defaults.get(f.name, default), docs.get(f.name, ""))


def from_args(cls: type, args: argparse.Namespace):
    """Build ``cls`` from the parsed flags; its InvalidArgument becomes a UsageError."""
    from duelq.server.core.errors import InvalidArgument
    try:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
    except InvalidArgument as exc:
        raise UsageError(f"{flag_name(exc.field)}: {exc.problem}") from None


DEMO_COUNTS = ("actors", "steps", "batch_size", "window", "sync_every")


def add_global_flags(parser: argparse.ArgumentParser, *, repeated: bool = False) -> None:
    """``--log-level`` and ``--log-format``, before the command; ``repeated`` adds them to a
    command too, where they override only when given (a subcommand's defaults would
    otherwise overwrite what was given before it)."""
    flags = [("log_level", "logging level (DEBUG, INFO, WARNING, ERROR; default INFO for "
                           "serve, WARNING for the other commands)", {}),
             ("log_format", "text, or json: one JSON object per line for log shippers",
              {"choices": ("text", "json")})]
    group = parser.add_argument_group("logging (before or after the command)")
    for dest, help, extra in flags:
        if repeated:
            group.add_argument(flag_name(dest), dest=dest, default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS, **extra)
        else:
            add_flag(group, dest, "str", "text" if dest == "log_format" else "", help, **extra)


def add_demo_flags(parser: argparse.ArgumentParser) -> None:
    from duelq.apps.gym_actor import FEEDS, TASKS
    group = parser.add_argument_group("demo (--token, if set, is also sent to --target)")
    add_flag(group, "target", "str", "", "host:port of a running server; empty starts one "
             "in-process")
    add_flag(group, "actors", "int", 4, "actor threads, one TrainStream each")
    add_flag(group, "steps", "int", 300, "batches per actor")
    add_flag(group, "batch_size", "int", 128, "transitions per batch (B)")
    add_flag(group, "window", "int", 8, "batches in flight per stream")
    add_flag(group, "sync_every", "int", 10, "batches between weight pulls")
    add_flag(group, "plot", "str", "duelq-demo-loss.png", "where to save the loss-curve PNG")
    add_flag(group, "demo_seed", "int", 1, "seed of the synthetic task and the actors")
    add_flag(group, "ready_timeout", "float", 30.0, "seconds to wait for the server's health "
             "to say SERVING")
    add_flag(group, "env", "str", "", "a gymnasium task with a known optimum instead of the "
             "synthetic one; sizes the head for it and applies the task's learner settings "
             "(such as --optimizer sgd) to the learner flags left at their defaults",
             choices=("",) + tuple(TASKS))
    add_flag(group, "env_steps", "int", 0, "environment steps per actor with --env; 0: as "
             "many as the task needs")
    add_flag(group, "feed", "str", "batches", "with --env, how the actors feed the learner: "
             "batches (TrainStep) sampled from replays of their own, or replay: each "
             "transition inserted once into the server's replay buffer (the in-process "
             "server gets one sized for the task), one TrainReplay step drawn from it where "
             "a batch would go", choices=tuple(FEEDS))


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("bench (--token, if set, is also sent to --target)")
    add_flag(group, "target", "str", "", "gRPC target of a running server (host:port or "
             "unix:///path); empty starts one in-process (needed for the null backend, the "
             "UDS cells and the server-side overhead)")
    add_flag(group, "batch_sizes", "str", "256,1024,4096", "comma-separated batch sizes B")
    add_flag(group, "actors", "int", 2, "actor processes of the by-batch-size table")
    add_flag(group, "scaling_actors", "str", "1,2,4,8", "actor counts of the scaling table; "
             "empty skips it")
    add_flag(group, "scaling_batch", "int", 1024, "B of the scaling table")
    add_flag(group, "transports", "str", "tcp,uds", "tcp and/or uds (Unix-domain socket); "
             "the first is the by-batch-size table's")
    add_flag(group, "wire_dtypes", "str", "float32,float16,bfloat16", "feature dtypes on the "
             "wire")
    add_flag(group, "duration", "float", 1.5, "measured seconds per cell")
    add_flag(group, "warmup", "float", 0.5, "unmeasured seconds before each cell")
    add_flag(group, "window", "int", 8, "batches in flight per stream")
    add_flag(group, "echo_processes", "int", 1, "processes serving the byte stream's TCP port "
             "(SO_REUSEPORT), as --front-processes does for a server: the ceiling of that "
             "server model")
    add_flag(group, "experiments", "bool", True, "also run the byte stream on grpc.aio, and "
             "it and the null learner with larger HTTP/2 windows and with tuned malloc")
    add_flag(group, "replay_cells", "bool", True, "also run replay cells: actors insert "
             "transitions of B rows into the server's replay buffer (in-process: one per B, "
             "replay ratio 8 unless --replay-ratio; --front-processes: one at the first B; "
             "--target: only if it has one), next to the stream cells of the same B")
    add_flag(group, "device_step", "bool", True, "on a cuda backend run from a duelq "
             "checkout, also time the device step against PyTorch (the checkout's device "
             "benchmark)")
    add_flag(group, "out", "str", "duelq-bench", "directory for bench.json and bench.png")
    add_flag(group, "quick", "bool", False, "a smoke run in seconds: B=256, 1–2 actors, "
             "0.25 s cells (overrides those flags)")
    add_flag(group, "ready_timeout", "float", 60.0, "seconds to wait for a server to be "
             "SERVING")


def add_health_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("health")
    add_flag(group, "target", "str", f"localhost:{os.environ.get(env_name('port'), 50051)}",
             "host:port of the server (the default follows DUELQ_PORT)")
    add_flag(group, "timeout", "float", 3.0, "seconds to wait for the answer")
    add_flag(group, "tls_ca", "str", "", "PEM CA bundle that signed the server's certificate; "
             "turns TLS on (empty: plaintext)")
    add_flag(group, "tls_server_name", "str", "", "the name the server's certificate must "
             "carry, when not the host of --target (a probe of localhost, say)")
    add_flag(group, "tls_client_cert", "str", "", "PEM client certificate chain, for a "
             "server that asks for one (duelq serve --tls-client-ca)")
    add_flag(group, "tls_client_key", "str", "", "PEM private key of --tls-client-cert")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or with ``command`` (a client install's case) of that
    one only: the others' flags come from modules that only the extras bring."""
    parser = argparse.ArgumentParser(
        prog="duelq", description="A gRPC learner service for a Dueling-DQN head.",
        epilog="Exit codes: 0 success, 1 runtime failure, 2 usage or configuration error "
               "(a replay buffer too large for its device too), "
               "3 refused checkpoint (corrupt, or other shapes), 130 demo "
               "interrupted. Every flag also reads DUELQ_<FLAG> from the environment.")
    parser.add_argument("--version", action="version", version=f"duelq {version()}")
    add_global_flags(parser)
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{" + ",".join(COMMANDS) + "}")

    def wanted(name: str) -> bool:
        return command is None or command == name

    def server_flags(sub, own: Callable[[argparse.ArgumentParser], None] | None, title: str,
                     defaults: dict[str, Any], backend_help: str) -> None:
        """--backend, the command's ``own`` flags, then ServerOptions' and LearnerConfig's."""
        from duelq.server.core.config import LearnerConfig
        from duelq.server.core.learner import BACKENDS
        from duelq.server.server import ServerOptions
        add_flag(sub, "backend", "str", "auto", backend_help, choices=BACKENDS)
        if own is not None:
            own(sub)
        add_dataclass_flags(sub, ServerOptions, title, defaults.get("server"))
        add_dataclass_flags(sub, LearnerConfig, "learner", defaults.get("learner"))

    auto = "auto picks cuda when a GPU is usable"
    serve = commands.add_parser("serve", help="run a learner server until SIGINT/SIGTERM",
                                description="Run a learner server until SIGINT or SIGTERM.")
    if wanted("serve"):
        server_flags(serve, None, "server and limits", {}, auto)
    demo = commands.add_parser(
        "demo", help="train with concurrent actors on synthetic data and summarise",
        description="Start a server in-process (or use --target), stream synthetic batches "
                    "from several actors, print a summary and save the loss curve; Ctrl-C "
                    "stops early with a partial summary.")
    if wanted("demo"):
        server_flags(demo, add_demo_flags, "in-process server and limits",
                     {"server": {"port": 0}, "learner": {"lr": 3e-3}}, auto)
    probe = commands.add_parser(
        "health", help="ask a server's grpc.health.v1 service whether it is SERVING",
        description="Exit 0 if the server at --target reports SERVING, 1 otherwise "
                    "(NOT_SERVING, unreachable, timed out). Used by the Docker HEALTHCHECK.")
    add_health_flags(probe)
    bench = commands.add_parser(
        "bench", help="throughput and latency of the service vs a bare gRPC byte stream",
        description="Drive a learner (in-process, or --target) with actor processes through "
                    "the client library; print throughput, latency and server overhead as "
                    "ratios to a bare gRPC byte stream measured in the same run; write "
                    "bench.json and bench.png under --out. With --front-processes the bench "
                    "starts that server (its --front-processes fronts and learner process) "
                    "and measures it as a --target. Exit 1 if a cell failed.")
    if wanted("bench"):
        server_flags(bench, add_bench_flags, "in-process server and limits",
                     {"server": {"port": 0}},
                     auto + "; every cell also runs on the null (no-op) backend")
    for sub in (serve, demo, probe, bench):
        add_global_flags(sub, repeated=True)
    return parser


def version() -> str:
    try:
        return importlib.metadata.version("duelq")
    except importlib.metadata.PackageNotFoundError:   # run from a checkout not installed
        return "(not installed)"


def install_command(extras: Sequence[str]) -> str:
    """The pip command that adds ``extras`` to this installation, from where it came."""
    spec = ",".join(extras)
    pip = f"{sys.executable} -m pip install"
    try:
        origin = json.loads(importlib.metadata.distribution("duelq").read_text(
            "direct_url.json") or "null")
    except importlib.metadata.PackageNotFoundError:
        origin = None
    if origin and "vcs_info" in origin:
        return f"{pip} 'duelq[{spec}] @ {origin['vcs_info']['vcs']}+{origin['url']}'"
    if origin and origin.get("url", "").startswith("file://"):
        path = unquote(urlparse(origin["url"]).path)
        editable = "-e " if origin.get("dir_info", {}).get("editable") else ""
        return f"{pip} {editable}'{path}[{spec}]'"
    return f"{pip} 'duelq[{spec}]'"


def missing_extras(command: str, argv: Sequence[str]) -> str | None:
    """One line naming the extras ``command`` needs and this installation lacks, or None."""
    needs = {extra: list(modules) for extra, modules in COMMAND_NEEDS.get(command, {}).items()}
    if command == "demo" and ("--env" in argv or any(a.startswith("--env=") for a in argv)
                              or os.environ.get(env_name("env"))):
        needs["demo"].append("gymnasium")
    if ("json" in argv or "--log-format=json" in argv
            or os.environ.get(env_name("log_format")) == "json"):
        needs.setdefault("server", []).append("pythonjsonlogger")
    lacking = [extra for extra, modules in needs.items()
               if any(importlib.util.find_spec(m) is None for m in modules)]
    if not lacking:
        return None
    what = f"duelq {command}" if command else "duelq"
    extras = f"{' and '.join(lacking)} extra{'s' if len(lacking) > 1 else ''}"
    return f"{what} needs the {extras}: {install_command(list(needs))}"


def health_check(args: argparse.Namespace) -> int:
    """One grpc.health.v1 Check of the Learner service; prints the status."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from duelq.client import errors, tls_credentials
    from duelq.v1 import learner_pb2 as pb
    service = pb.DESCRIPTOR.services_by_name["Learner"].full_name
    tls = args.tls_ca or args.tls_client_cert
    try:
        credentials = tls and tls_credentials(args.tls_ca or None,
                                              args.tls_client_cert or None,
                                              args.tls_client_key or None)
    except errors.InvalidArgument as exc:
        flag = {"ca": "--tls-ca", "cert": "--tls-client-cert", "key": "--tls-client-key"}
        raise UsageError(f"{flag[exc.field]}: {exc.details.split(': ', 1)[-1]}") from None
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] \
        if tls and args.tls_server_name else []
    channel = (grpc.secure_channel(args.target, credentials, options) if tls
               else grpc.insecure_channel(args.target))
    with channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.target}: {exc.code().name}: {exc.details()}")
            return EXIT_FAILURE
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    print(f"{args.target}: {status}")
    return EXIT_OK if answer.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILURE


def serve(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM: bind, resume or build the learner, SERVING; on a signal
    NOT_SERVING, drain, final checkpoint, exit 0."""
    from duelq.server.core.checkpoint import CheckpointError
    from duelq.server.core.config import LearnerConfig
    from duelq.server.core.errors import InvalidArgument, ReplayTooLarge
    from duelq.server.fronts import make_server
    from duelq.server.server import ServerOptions, tune_malloc
    config, options = from_args(LearnerConfig, args), from_args(ServerOptions, args)
    tune_malloc()   # before the learner and front processes start: they inherit it
    try:
        server = make_server(options)
    except InvalidArgument as exc:  # an unreadable or empty --token-file
        raise UsageError(f"{flag_name(exc.field)}: {exc.problem}") from None
    try:
        server.start()
    except OSError as exc:
        log.error("%s", exc)
        return EXIT_FAILURE
    stop = threading.Event()

    def on_signal(signum, frame):
        log.info("%s received: shutting down", signal.Signals(signum).name)
        stop.set()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    try:
        server.serve_learner(config, backend=args.backend)
    except CheckpointError as exc:
        log.error("%s; refusing to start (move the file away to start fresh, or fix the "
                  "configuration to match it)", exc)
        server.stop(0)
        return EXIT_CHECKPOINT
    except ReplayTooLarge as exc:
        log.error("%s: refusing to start (lower --replay-capacity, or store 16-bit rows with "
                  "--replay-dtype)", exc)
        server.stop(0)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 — any backend failure ends the command
        log.error("cannot start the %s backend: %s", args.backend, exc)
        server.stop(0)
        return EXIT_FAILURE
    while not stop.wait(0.5):
        if options.front_processes and server.broken.is_set():
            log.error("the learner process died; exiting")
            server.stop(0)
            return EXIT_FAILURE
    log.info("draining: finishing admitted steps%s; running rpcs get up to %g s",
             ", then the final checkpoint" if options.checkpoint_dir else "", options.grace_s)
    try:
        saved = server.stop()
    except CheckpointError as exc:
        log.error("final checkpoint failed: %s", exc)
        return EXIT_FAILURE
    if saved is not None:
        log.info("final checkpoint %s at step %d", *saved)
    return EXIT_OK


def demo(args: argparse.Namespace) -> int:
    from duelq.apps.demo import run_demo
    from duelq.apps.gym_actor import ActorConfig
    from duelq.apps.gym_demo import env_config, run_env_demo
    from duelq.server.core.config import LearnerConfig
    from duelq.server.core.errors import InvalidArgument
    from duelq.server.server import ServerOptions
    for name in DEMO_COUNTS:
        if getattr(args, name) < 1:
            raise UsageError(f"{flag_name(name)}: must be ≥ 1")
    # SIGINT stops the demo cleanly (a partial summary) even where it was started ignoring
    # it, as a shell script's background job is.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.env_steps and args.env_steps <= ActorConfig.warmup:
        raise UsageError(f"--env-steps: must be 0 (the task's own) or more than the "
                         f"{ActorConfig.warmup} warm-up steps")
    if args.feed == "replay" and not args.env:
        raise UsageError("--feed replay: needs --env (the synthetic demo streams batches)")
    options = from_args(ServerOptions, args)
    config = from_args(LearnerConfig, args)
    if args.env:
        defaults = from_args(LearnerConfig, build_parser("demo").parse_args(["demo"]))
        try:
            config = env_config(args.env, config, defaults, args.feed)
        except InvalidArgument as exc:
            raise UsageError(f"{flag_name(exc.field)}: {exc.problem}") from None
    return run_demo(args, config, options, run_env_demo if args.env else None)


def bench(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from duelq.apps.bench import run_bench
    from duelq.server.core.config import LearnerConfig
    from duelq.server.server import ServerOptions
    return run_bench(args, from_args(LearnerConfig, args), from_args(ServerOptions, args), argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``duelq`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if a in COMMANDS), "")
    if (missing := missing_extras(command, argv)) is not None:
        print(f"duelq: {missing}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        args = build_parser(command).parse_args(argv)
        level = (args.log_level or ("INFO" if args.command == "serve" else "WARNING")).upper()
        if not isinstance(logging.getLevelName(level), int):
            raise UsageError(f"--log-level: unknown level {args.log_level!r}")
        setup_logging(level, args.log_format)
        if args.command == "serve":
            return serve(args)
        if args.command == "health":
            return health_check(args)
        if args.command == "bench":
            return bench(args, argv)
        return demo(args)
    except UsageError as exc:
        print(f"duelq: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:   # before the demo's actors ran, or in serve's start-up
        print("duelq: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
