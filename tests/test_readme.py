"""The README's quickstart test command is exactly what CI runs."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    cmd = re.search(r"^TEST_CMD='(.*)'$", ci, re.M).group(1)
    assert cmd in open(os.path.join(ROOT, "README.md")).read()
