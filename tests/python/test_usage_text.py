"""Every tool's usage text names every flag the tool accepts: the flags are read from the tool's own argument
parsing (each `Args::Parse` call in its sources), the usage text from the built binary (a flag it does not know
makes it print its usage)."""
import os
import re
import subprocess

import pytest

from conftest import REPO, binary

TOOLS = {"engram-replica": ["tools/replica.cc"], "engram-mkckpt": ["tools/mkckpt.cc"],
         "engramctl": ["tools/engramctl.cc", "tools/ctl_attach.cc", "tools/ctl_offline.cc", "tools/ctl_operator.cc",
                       "tools/ctl_status.cc"]}


def parsed_flags(files):
    """The flags of every `.Parse(argc, argv, n, {...}, {...})` call in `files`."""
    flags = set()
    for f in files:
        text = open(os.path.join(REPO, f), encoding="utf-8").read()
        for m in re.finditer(r"\.Parse\(argc, argv, \d+,(.*?)\);", text, re.S):
            flags |= set(re.findall(r'"(--[a-z0-9-]+)"', m.group(1)))
    return flags


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_the_usage_text_lists_every_flag(tool):
    if not os.path.isfile(os.path.join(REPO, TOOLS[tool][0])):
        pytest.skip(f"no {TOOLS[tool][0]} here (these tests run outside a source tree)")
    flags = parsed_flags(TOOLS[tool])
    assert flags, f"no Parse call found in {TOOLS[tool]}"
    r = subprocess.run([binary(f"tools/{tool}"), "--no-such-flag"], capture_output=True, text=True, timeout=30)
    usage = r.stdout + r.stderr
    assert r.returncode != 0 and "usage" in usage, usage
    missing = sorted(f for f in flags if f not in usage)
    assert not missing, f"{tool}'s usage text lacks {', '.join(missing)}:\n{usage}"
