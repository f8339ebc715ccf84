"""User mistakes end in one clear line and a non-zero exit, never a traceback."""
import argparse
import logging
import os
import sys


class UserError(Exception):
    """Something the user can fix (a path, a flag, a dataset column). Printed as one line, exit code 2."""


class RecipeArgumentParser(argparse.ArgumentParser):
    """argparse, but an invalid flag is one line on stderr (no usage block), exit code 2."""

    def error(self, message):
        raise UserError(message)


def _is_rank_zero():
    return os.environ.get("RANK", "0") == "0"


def run(main, parse_args, argv=None):
    """Parse the flags and run `main(args)`; turn a UserError into `error: <message>` and exit 2."""
    # A handler for the scripts' own INFO loggers; libraries keep their WARNING levels.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        main(parse_args(argv))
    except UserError as err:
        if _is_rank_zero():  # one line, not one per process
            print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
