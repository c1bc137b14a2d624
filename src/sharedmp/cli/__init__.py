"""The command line: ``python -m sharedmp {doctor,bench,demo,stress} ...`` (also the
``sharedmp`` script).

Each subcommand lives in its own module ``sharedmp.cli.<name>`` which exposes

    add_parser(subparsers) -> argparse.ArgumentParser   # registers itself under its name
    run(args) -> int                                     # the exit status

Only the module of the command being run is imported, so ``doctor`` never pulls in
torch or matplotlib, whatever ``bench`` and ``demo`` import. The other commands get a
placeholder entry (name and one-line help) so that ``--help`` lists them all.
"""
import argparse
import importlib
import importlib.util
import sys

# name -> one-line help. A command whose module does not exist (yet) is not offered.
COMMANDS = {
    "demo": "Hogwild training of a real model with N processes sharing its parameters",
    "bench": "speed against torch.multiprocessing and the standard library, side by side",
    "doctor": "what this machine supports and where sharedmp would fail (exit 1 on problems)",
    "stress": "producers and consumers under random SIGKILLs: messages lost, corrupted, leftovers",
}


# A module a command needs -> the extra that installs it.
# (tqdm is the demo's too, but it does without: plain progress lines.)
EXTRAS = {"torch": "demo", "sklearn": "demo", "matplotlib": "bench"}


def dist_version(name):
    """The installed version of distribution ``name`` without importing it, or None."""
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _module_name(command):
    return f"{__name__}.{command}"


def available_commands():
    """The commands whose module is installed, in COMMANDS order."""
    return [c for c in COMMANDS if importlib.util.find_spec(_module_name(c)) is not None]


def _selected(argv, commands):
    """The command named in argv: the first token that is not an option."""
    for token in argv:
        if token == "--":
            break
        if not token.startswith("-"):
            return token if token in commands else None
    return None


def build_parser(argv=()):
    """The parser, with the full sub-parser of the command named in ``argv`` (if any).

    Returns (parser, module of the selected command or None).
    """
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="python -m sharedmp",
        description="sharedmp: multiprocessing with arrays in shared memory.")
    parser.add_argument("--version", action="version", version=f"sharedmp {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    subparsers.required = True
    commands = available_commands()
    chosen = _selected(argv, commands)
    module = None
    for name in commands:
        if name == chosen:
            module = importlib.import_module(_module_name(name))
            module.add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=COMMANDS[name], description=COMMANDS[name],
                                  add_help=False)
    return parser, module


def main(argv=None):
    """Parse ``argv`` (default: sys.argv[1:]), run the command, return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser, module = build_parser(argv)
        args = parser.parse_args(argv)
        if module is None:        # cannot happen: argparse rejects unknown commands
            parser.error(f"unknown command {args.command!r}")
        return int(module.run(args) or 0)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        command = _selected(argv, COMMANDS) or "this command"
        print(f"error: `{command}` needs {top}, which is not installed: "
              f"pip install 'sharedmp[{EXTRAS[top]}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:       # e.g. `python -m sharedmp doctor | head`
        import os
        devnull = os.open(os.devnull, os.O_WRONLY)   # the recipe of the signal module's docs
        os.dup2(devnull, sys.stdout.fileno())
        return 1
