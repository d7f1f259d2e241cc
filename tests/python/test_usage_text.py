"""Every tool's usage text names every flag the tool accepts, where it belongs: the flags are read from the tool's
own argument parsing (each `Args::Parse` call in its sources; engramd's option keys), the usage text from the built
binary (a flag it does not know makes it print its usage). engramctl's flags are checked against the usage lines of
their own command, and a flag counts only as a whole word (`--dp` is not found in `--dp-size`)."""
import os
import re
import subprocess

import pytest

from conftest import REPO, build_dir

# tool: (binary under the build directory, its sources)
TOOLS = {"engram-replica": ("tools/engram-replica", ["tools/replica.cc"]),
         "engram-mkckpt": ("tools/engram-mkckpt", ["tools/mkckpt.cc"]),
         "engram-prewarm": ("daemon/engram-prewarm", ["tools/prewarm.cc"])}
CTL_SOURCES = ["tools/ctl_attach.cc", "tools/ctl_offline.cc", "tools/ctl_operator.cc", "tools/ctl_status.cc"]


def source(rel):
    path = os.path.join(REPO, rel)
    if not os.path.isfile(path):
        pytest.skip(f"no {rel} here (these tests run outside a source tree)")
    return open(path, encoding="utf-8").read()


def parse_flags(text):
    """The flags of every `.Parse(argc, argv, n, {...}, {...})` call in `text`."""
    flags = set()
    for m in re.finditer(r"\.Parse\(argc, argv, \d+,(.*?)\);", text, re.S):
        flags |= set(re.findall(r'"(--[a-z0-9-]+)"', m.group(1)))
    return flags


def names(usage, flag):
    return re.search(re.escape(flag) + r"(?![a-z0-9-])", usage) is not None


def usage_of(path, *args):
    exe = os.path.join(build_dir(), path)
    if not os.path.exists(exe):
        pytest.skip(f"{path} is not built here")
    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    return r, r.stdout + r.stderr


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_the_usage_text_lists_every_flag(tool):
    path, files = TOOLS[tool]
    flags = set().union(*(parse_flags(source(f)) for f in files))
    assert flags, f"no Parse call found in {files}"
    r, usage = usage_of(path, "--no-such-flag")
    assert r.returncode == 2 and "usage" in usage, usage
    missing = sorted(f for f in flags if not names(usage, f))
    assert not missing, f"{tool}'s usage text lacks {', '.join(missing)}:\n{usage}"


def ctl_commands():
    """{command: flags} from each `int CmdName(...)` function of engramctl's sources."""
    out = {}
    for f in CTL_SOURCES:
        text = source(f)
        starts = [(m.start(), m.group(1).lower()) for m in re.finditer(r"^int Cmd(\w+)\(", text, re.M)]
        for i, (at, cmd) in enumerate(starts):
            end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
            out[cmd] = parse_flags(text[at:end])
    return out


def ctl_blocks(usage):
    """{command: its usage lines}: a command's line starts with two spaces and the command, its continuation lines
    with more spaces."""
    blocks, cur = {}, None
    for line in usage.splitlines():
        m = re.match(r"^  ([a-z]+)\b", line)
        if m:
            cur = m.group(1)
            blocks[cur] = line
        elif cur and line.startswith("   "):
            blocks[cur] += "\n" + line
        else:
            cur = None
    return blocks


def test_engramctl_lists_each_commands_flags_on_its_own_lines():
    commands = ctl_commands()
    assert {"plan", "attach", "status", "load"} <= set(commands), commands
    r, usage = usage_of("tools/engramctl", "--help")
    assert r.returncode == 0, usage
    blocks = ctl_blocks(usage)
    for cmd, flags in sorted(commands.items()):
        assert cmd in blocks, f"engramctl's usage has no line for {cmd}:\n{usage}"
        missing = sorted(f for f in flags if not names(blocks[cmd], f))
        assert not missing, f"engramctl {cmd}: its usage lines lack {', '.join(missing)}:\n{blocks[cmd]}"


def test_engramd_lists_every_option():
    text = source("daemon/options.cc")
    keys = set(re.findall(r'key == "([a-z_]+)"', text))
    assert {"checkpoint", "tickets", "metrics_address", "prewarm_registration"} <= keys, keys
    r, usage = usage_of("daemon/engramd", "--help")
    assert r.returncode == 0, usage
    flags = {"--" + k.replace("_", "-") for k in keys} | {"--config", "--version"}
    missing = sorted(f for f in flags if not names(usage, f))
    assert not missing, f"engramd's usage text lacks {', '.join(missing)}:\n{usage}"
