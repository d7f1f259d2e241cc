"""How the package finds and checks libengram_c.so, and where the library's log lines go: importing engram (and the
engines' plugins) never loads the library; the first use does, and a library that is missing, not a library, of
another C ABI or (for an installed package) of another version is a LibraryError naming both sides; once loaded,
the library's own lines reach Python's logging (logger `engram`, or the plugin's) at their level, unless
ENGRAM_LOG_STDERR is set. Each case runs in a fresh interpreter (the library is loaded once per process)."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")


def run(code, env_extra=None, pkg=PKG):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_LOG")}
    env["PYTHONPATH"] = pkg
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def fake_library(tmp_path, name, body):
    """A shared library compiled here from `body` (C): a stand-in for a library of another build."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in library")
    src = tmp_path / f"{name}.c"
    src.write_text(body)
    out = tmp_path / f"{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return str(out)


def test_import_never_loads_the_library_and_first_use_names_what_is_wrong(tmp_path):
    bogus = tmp_path / "libengram_c.so"
    bogus.write_bytes(b"\x7fELF but not really")
    r = run("""
        import engram, engram.vllm, engram.sglang, engram._lib as L
        assert L.loaded_path() is None
        try:
            engram.attach("/nonexistent", timeout_ms=100)
        except engram.LibraryError as e:
            print("ERR", e.code_name, e)
        try:
            engram.status("/nonexistent.sock")
        except engram.LibraryError as e:
            print("AGAIN", e)
    """, {"ENGRAM_LIB": str(bogus)})
    assert r.returncode == 0, r.stderr
    assert f"ERR FAILED_PRECONDITION FAILED_PRECONDITION: {bogus} cannot be loaded" in r.stdout, r.stdout
    assert "AGAIN" in r.stdout and str(bogus) in r.stdout.split("AGAIN")[1], r.stdout


def test_a_missing_library_lists_where_it_looked(tmp_path):
    r = run("""
        import engram
        try:
            engram.status("/nonexistent.sock")
        except engram.LibraryError as e:
            print(e)
    """, {"ENGRAM_LIB": str(tmp_path / "absent.so")})
    assert r.returncode == 0, r.stderr
    assert "libengram_c.so not found" in r.stdout and str(tmp_path / "absent.so") in r.stdout, r.stdout


def test_a_library_of_another_c_abi_is_refused_naming_both(tmp_path):
    lib = fake_library(tmp_path, "other_abi", "int engram_abi_version(void){return 999;}\n"
                                            "const char* engram_version(void){return \"9.9.9\";}\n")
    r = run("""
        import engram, engram._lib as L
        try:
            L.load()
        except engram.LibraryError as e:
            print(e)
        print("ABI", L.ABI_VERSION)
    """, {"ENGRAM_LIB": lib})
    assert r.returncode == 0, r.stderr
    line = r.stdout.splitlines()[0]
    abi = r.stdout.split("ABI ")[-1].strip()
    assert f"{lib} is engram 9.9.9 (C ABI 999)" in line and f"(C ABI {abi})" in line, line


def test_a_library_without_a_version_is_an_older_build(tmp_path):
    lib = fake_library(tmp_path, "no_version", "int engram_something(void){return 0;}\n")
    r = run("""
        import engram, engram._lib as L
        try:
            L.load()
        except engram.LibraryError as e:
            print(e)
    """, {"ENGRAM_LIB": lib})
    assert "reports no C ABI version: it is an older build" in r.stdout, (r.stdout, r.stderr)


def test_an_installed_package_refuses_a_library_of_another_version(tmp_path):
    import engram._lib
    real = engram._lib.path  # the library this test process uses (a build's, or the installed wheel's)
    pkg = tmp_path / "site"
    shutil.copytree(os.path.join(PKG, "engram"), pkg / "engram")
    (pkg / "engram" / "_version.py").write_text('__version__ = "0.0.1"\n')
    r = run("""
        import engram, engram._lib as L
        print("PKG", engram.__version__)
        try:
            L.load()
        except engram.LibraryError as e:
            print(e)
    """, {"ENGRAM_LIB": real}, pkg=str(pkg))
    assert r.returncode == 0, r.stderr
    assert "PKG 0.0.1" in r.stdout and "which the engram package 0.0.1" in r.stdout, r.stdout
    # The same package over a source tree (no version file) takes the library's version as its own.
    r = run("""
        import engram
        print(engram.__version__)
    """, {"ENGRAM_LIB": real})
    assert r.returncode == 0 and r.stdout.strip().count(".") == 2, (r.stdout, r.stderr)


def test_the_librarys_lines_go_to_pythons_logging_or_stderr_when_asked(daemon, checkpoint):
    code = f"""
        import logging, sys
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="PY %(name)s %(levelname)s %(message)s")
        import engram
        t = engram.attach({checkpoint!r}, socket={daemon.socket!r}, backend="cpu")
        t.close()
    """
    r = run(code)
    assert r.returncode == 0, r.stderr
    attached = [ln for ln in r.stdout.splitlines() if "event=attached" in ln]
    assert attached and attached[0].startswith("PY engram INFO engram: event=attached mode="), r.stdout
    assert "event=attached" not in r.stderr, r.stderr
    r = run(code, {"ENGRAM_LOG_STDERR": "1"})
    assert r.returncode == 0, r.stderr
    assert "event=attached" in r.stderr and "PY engram" not in r.stdout, (r.stdout, r.stderr)


def test_a_plugin_routes_the_librarys_lines_into_its_engines_logger(daemon, checkpoint):
    r = run(f"""
        import logging, sys
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="PY %(name)s %(message)s")
        import engram, engram._lib as L
        L.route_log("vllm.engram")
        engram.attach({checkpoint!r}, socket={daemon.socket!r}, backend="cpu").close()
    """)
    assert r.returncode == 0, r.stderr
    assert any(ln.startswith("PY vllm.engram engram: event=attached") for ln in r.stdout.splitlines()), r.stdout


def test_a_relative_engram_lib_is_the_file_it_names(tmp_path):
    import engram._lib
    real = engram._lib.path
    d = tmp_path / "here"
    d.mkdir()
    shutil.copy(real, d / "libengram_c.so")
    libs = os.path.join(os.path.dirname(real), ".libs")  # the wheel's: the libraries it loads, beside it
    if os.path.isdir(libs):
        shutil.copytree(libs, d / ".libs")
    r = subprocess.run([sys.executable, "-c", "import engram, engram._lib as L; L.load(); print(L.loaded_path())"],
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_LOG")},
                            "PYTHONPATH": PKG, "ENGRAM_LIB": "libengram_c.so", "LD_LIBRARY_PATH": ""},
                       cwd=str(d), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(d / "libengram_c.so"), r.stdout
