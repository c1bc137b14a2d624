"""docs/API.md's section on the command line names every command, each with options it has."""
import re
from pathlib import Path

import pytest

from sharedmp import cli

API = Path(__file__).resolve().parent.parent / "docs" / "API.md"
SYNOPSIS = re.compile(r"`python -m sharedmp (\w+)((?: \[[^\]`]+\])*)`")


def command_line_section():
    text = API.read_text()
    start = text.index("## 8. Command line")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def documented():
    """{command: [its options]} of the section's synopses."""
    return {m.group(1): re.findall(r"--[\w-]+", m.group(2))
            for m in SYNOPSIS.finditer(command_line_section())}


def test_every_command_is_in_the_command_line_section():
    assert set(documented()) == set(cli.available_commands())


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_documented_options_are_the_commands(command):
    options = documented().get(command)
    if options is None:
        pytest.skip(f"{command} is not installed here")
    parser, module = cli.build_parser([command])
    assert module is not None
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    known = {s for a in sub._actions for s in a.option_strings}
    assert set(options) <= known, f"{command}: {sorted(set(options) - known)} are not options"
