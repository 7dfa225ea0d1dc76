"""
nanoGPT-style configuration: `python script.py [config/x.py ...] [--key=value ...]`.

A config file is plain Python assignments; --key=value overrides come after. Every key must
already exist in the script's defaults and keep its type, so a typo fails loudly instead of
being silently ignored.
"""

import ast


class ConfigError(ValueError):
    """A bad command line or config file; the message is one line that names the fix."""


def _check(key, value, defaults, where):
    if key not in defaults:
        close = [k for k in defaults if k.startswith(key[:3])]
        hint = f" (did you mean {', '.join(close[:3])}?)" if close else ""
        raise ConfigError(f"unknown config key '{key}' in {where}{hint}")
    default = defaults[key]
    if default is None or value is None:
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(default, bool) and isinstance(value, bool)
    elif isinstance(default, float) and isinstance(value, int):
        value, ok = float(value), True
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"config key '{key}' in {where} expects {type(default).__name__}, "
                          f"got {type(value).__name__} {value!r}")
    return value


def configure(argv, defaults):
    """Return a copy of `defaults` updated from config files and --key=value arguments."""
    config = dict(defaults)
    for arg in argv:
        if not arg.startswith("--"):
            try:
                with open(arg) as f:
                    source = f.read()
            except OSError as e:
                raise ConfigError(f"cannot read config file '{arg}': {e.strerror}") from None
            namespace = {}
            exec(compile(source, arg, "exec"), {}, namespace)
            for key, value in namespace.items():
                if not key.startswith("_") and not callable(value) and type(value).__name__ != "module":
                    config[key] = _check(key, value, defaults, arg)
        else:
            key, sep, text = arg[2:].partition("=")
            if not sep:
                raise ConfigError(f"expected --key=value, got '{arg}'")
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                value = text  # a bare string such as --residual=nag
            config[key] = _check(key, value, defaults, f"'{arg}'")
    return config
