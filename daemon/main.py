"""`expertd`: the expert-storage daemon's command line. Exit status 0 after a clean shutdown
(SIGTERM, and SIGINT, SIGHUP, SIGUSR1 or SIGUSR2 alike: server.STOP_SIGNALS), 2 when the
configuration, the pack or the environment is unusable (one line says why: fail-closed, before
anything is served)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from expertpack.packtools.errors import ManifestError

from .config import ConfigError, add_flags, load_config
from .reader import PackContractError
from .staging import StagingError

log = logging.getLogger("expertd")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="expertd",
        description="The expert-storage daemon: serves the experts of one pack from the SSD (O_DIRECT) through "
                    "shared, locked staging memory to inference workers over ZeroMQ. Settings come from "
                    "--config FILE (TOML, keys as below with underscores) and are overridden by flags.",
    )
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML file, e.g. /etc/expertpack/expertd.toml")
    add_flags(parser)
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args)
    except ConfigError as exc:
        print(f"expertd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(stream=sys.stderr, level=config.log_level.upper(),
                        format="expertd[%(process)d] %(levelname)s %(message)s")
    import zmq

    from .server import STOP_SIGNALS, ExpertDaemon  # zmq and the pack are only touched once the config is sound

    _interrupt_start_on(STOP_SIGNALS)
    try:
        daemon = ExpertDaemon(config)
    except (ManifestError, PackContractError, StagingError, ValueError, TypeError, OSError, zmq.ZMQError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    except KeyboardInterrupt as exc:
        log.info("interrupted during start-up%s", f" ({exc})" if exc.args else "")
        return 0
    try:
        return daemon.serve()
    except KeyboardInterrupt as exc:  # before serve() had its own handlers in place
        daemon.close()
        log.info("interrupted during start-up%s", f" ({exc})" if exc.args else "")
        return 0


def _interrupt_start_on(signals: tuple[signal.Signals, ...]) -> None:
    """Until serve() installs its own handlers, each of `signals` interrupts the start-up (which
    cleans up), once: a second must not cut the clean-up short."""
    def interrupt(signum: int, frame: object) -> None:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for s in signals:
        signal.signal(s, interrupt)


if __name__ == "__main__":
    sys.exit(main())
