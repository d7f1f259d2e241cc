"""The SGLang plugin's settings, from the environment (SGLang is configured that way): ENGRAM_SGLANG_SOCKET or
ENGRAM_SGLANG=1, ENGRAM_SGLANG_REQUIRE, ENGRAM_SGLANG_CHECKPOINT, ENGRAM_SGLANG_TIMEOUT_MS (engram.sglang says what
each does), and the running SGLang's version for the log. Pure functions; thread-safe."""
import os

from .. import _plugin

DEFAULT_SOCKET = "/run/engramd/engramd.sock"


class PluginConfig:
    def __init__(self, socket=DEFAULT_SOCKET, require=False, checkpoint=None, timeout_ms=10000):
        self.socket, self.require, self.checkpoint, self.timeout_ms = socket, require, checkpoint, timeout_ms


def plugin_config(environ=None):
    """The PluginConfig the environment gives, or None when the plugin is not configured; ValueError for a value
    that does not parse."""
    env = os.environ if environ is None else environ

    def boolean(name):
        try:
            return _plugin.env_bool(name, env.get(name, ""))
        except ValueError as e:
            raise ValueError(f"engram.sglang: {e}") from None

    if not env.get("ENGRAM_SGLANG_SOCKET") and not boolean("ENGRAM_SGLANG"):
        return None
    cfg = PluginConfig(socket=env.get("ENGRAM_SGLANG_SOCKET") or DEFAULT_SOCKET,
                       require=boolean("ENGRAM_SGLANG_REQUIRE"),
                       checkpoint=env.get("ENGRAM_SGLANG_CHECKPOINT") or None)
    if env.get("ENGRAM_SGLANG_TIMEOUT_MS"):
        try:
            cfg.timeout_ms = int(env["ENGRAM_SGLANG_TIMEOUT_MS"])
        except ValueError:
            raise ValueError(f"engram.sglang: ENGRAM_SGLANG_TIMEOUT_MS={env['ENGRAM_SGLANG_TIMEOUT_MS']!r}: expected "
                             "an integer") from None
        if cfg.timeout_ms < 1:
            raise ValueError(f"engram.sglang: ENGRAM_SGLANG_TIMEOUT_MS must be >= 1, got {cfg.timeout_ms}")
    return cfg


def sglang_version():
    import sys
    s = sys.modules.get("sglang")
    return getattr(s, "__version__", "unknown") if s is not None else "not imported"
