"""docs/configuration.md names every setting the product reads.

Scans the product sources (wherever their files live under the listed top-level folders) for environment variables
read and for engramd's command-line flags, and asserts that each one appears in docs/configuration.md. Uses only the
standard library and pytest, so it runs with Debian's /usr/bin/python3:

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/docs
"""
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "configuration.md"

# Product source folders; a folder that does not exist (the tree is reorganised from time to time) is skipped.
PRODUCT_DIRS = ["client", "daemon", "kernels", "model", "shm", "tools", "io", "net", "include", "base",
                "python/engram"]
SOURCE_SUFFIXES = {".cc", ".cpp", ".cxx", ".c", ".h", ".hh", ".hpp", ".cu", ".cuh", ".py"}

# Ways a name is read from the environment. Each pattern captures the variable's name.
ENV_PATTERNS = [
    re.compile(r"\bgetenv\s*\(\s*\"([A-Za-z_][A-Za-z0-9_]*)\""),            # std::getenv("X"), getenv("X")
    re.compile(r"\bsecure_getenv\s*\(\s*\"([A-Za-z_][A-Za-z0-9_]*)\""),
    re.compile(r"\bos\.environ\.get\(\s*[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']"),  # os.environ.get("X")
    re.compile(r"\bos\.environ\[\s*[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']\s*\]"),  # os.environ["X"]
    re.compile(r"\bos\.getenv\(\s*[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']"),        # os.getenv("X")
    re.compile(r"[\"'](ENGRAM_[A-Z0-9_]+)[\"']"),                             # any "ENGRAM_..." string literal
]
# The client's tuning knobs are read as ENGRAM_<KEY> from a table of keys: {"host_gather_threads", &Tuning::...}.
TUNING_KEY = re.compile(r"\{\s*\"([a-z][a-z0-9_]*)\"\s*,\s*&Tuning::")


def product_files():
    for top in PRODUCT_DIRS:
        root = REPO / top
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.suffix in SOURCE_SUFFIXES:
                yield path


def read(path):
    return path.read_text(encoding="utf-8", errors="replace")


def env_vars():
    """{name: [files that read it]}"""
    found = {}
    for path in product_files():
        text = read(path)
        for pattern in ENV_PATTERNS:
            for m in pattern.finditer(text):
                found.setdefault(m.group(1), set()).add(str(path.relative_to(REPO)))
        for m in TUNING_KEY.finditer(text):
            found.setdefault("ENGRAM_" + m.group(1).upper(), set()).add(str(path.relative_to(REPO)))
    return found


def daemon_option_files():
    """The daemon's option parser, wherever it lives: files under daemon/ (or any product folder) that define or
    call ParseOptions, plus the daemon's main (its usage text)."""
    files = []
    for path in product_files():
        if path.suffix == ".py":
            continue
        rel = str(path.relative_to(REPO))
        text = read(path)
        if "ParseOptions" in text and "daemon" in rel:
            files.append(path)
    return files


# engramd's parser compares each key (the flag's name with '-' as '_') against string literals:
#   key == "shm_dir"   or   name == "config"   or   a == "--config"
KEY_COMPARE = re.compile(r"\b(?:key|name|flag|k)\s*==\s*\"([a-z][a-z0-9_]*)\"")
FLAG_LITERAL = re.compile(r"\"(--[a-z][a-z0-9-]*)")
# A table of keys, if the parser is ever written as one: {"shm_dir", &Options::shm_dir} or {"shm-dir", ...}
KEY_TABLE = re.compile(r"\{\s*\"([a-z][a-z0-9_-]*)\"\s*,\s*&")


def daemon_flags():
    """{flag: file} for every engramd flag (and, for keys, also the config-file spelling)."""
    flags = {}
    for path in daemon_option_files():
        text = read(path)
        rel = str(path.relative_to(REPO))
        for m in KEY_COMPARE.finditer(text):
            flags.setdefault("--" + m.group(1).replace("_", "-"), rel)
        for m in KEY_TABLE.finditer(text):
            flags.setdefault("--" + m.group(1).replace("_", "-"), rel)
        for m in FLAG_LITERAL.finditer(text):
            flag = m.group(1)
            if flag.endswith("-"):
                continue
            flags.setdefault(flag, rel)
    return flags


def mentioned(doc, word):
    return re.search(r"(?<![A-Za-z0-9_-])" + re.escape(word) + r"(?![A-Za-z0-9_-])", doc) is not None


def test_the_reference_exists():
    assert DOC.is_file(), f"{DOC.relative_to(REPO)} is missing"


def test_extraction_finds_the_settings():
    # Guards the scanners themselves: if the sources move or change form so that nothing is found, the other tests
    # would pass vacuously.
    flags = daemon_flags()
    for expected in ("--checkpoint", "--tp", "--shm-dir", "--socket"):
        assert expected in flags, (f"could not find engramd's flag {expected} in the daemon's option parser "
                                   f"(searched {[str(p.relative_to(REPO)) for p in daemon_option_files()]}); "
                                   "update tests/docs/test_configuration_reference.py's extraction")
    names = env_vars()
    assert any(n.startswith("ENGRAM_") for n in names), "found no ENGRAM_* environment variable in the sources"
    assert "ENGRAM_HOST_GATHER_THREADS" in names, ("found no tuning knob (client/tuning.cc's table of keys); update "
                                                   "tests/docs/test_configuration_reference.py's extraction")


def test_every_environment_variable_is_documented():
    doc = read(DOC)
    missing = {name: sorted(files) for name, files in env_vars().items() if not mentioned(doc, name)}
    assert not missing, ("docs/configuration.md does not mention these environment variables read by the code: " +
                         "; ".join(f"{n} (read in {', '.join(f)})" for n, f in sorted(missing.items())))


def test_every_daemon_flag_is_documented():
    doc = read(DOC)
    missing = {}
    for flag, where in daemon_flags().items():
        if not mentioned(doc, flag):
            missing[flag] = where
    assert not missing, ("docs/configuration.md does not mention these engramd flags: " +
                         "; ".join(f"{f} (from {w})" for f, w in sorted(missing.items())))


def test_every_daemon_config_key_is_documented():
    doc = read(DOC)
    missing = []
    for path in daemon_option_files():
        for m in KEY_COMPARE.finditer(read(path)):
            key = m.group(1)
            if key in ("config", "help"):
                continue  # command-line only
            if not mentioned(doc, key) and not mentioned(doc, "`" + key + "`"):
                missing.append(f"{key} (from {path.relative_to(REPO)})")
    assert not missing, "docs/configuration.md does not mention these engramd config-file keys: " + "; ".join(
        sorted(set(missing)))
