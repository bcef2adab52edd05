"""The one ``sightline`` command and its subcommands' help."""

import subprocess
import sys

import pytest

SUBCOMMANDS = [["demo"], ["engine", "serve"], ["collector", "run"], ["dashboards", "build"]]


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=" ".join)
def test_every_subcommand_has_help(words):
    result = subprocess.run([sys.executable, "-m", "sightline.deploy.cli", *words, "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: sightline " + " ".join(words) in result.stdout
