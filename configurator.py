"""
nanoGPT-style configuration: `python script.py [config/x.py ...] [--key=value ...]`.

A config file is plain Python assignments; --key=value overrides come after. Every key must
already exist in the script's defaults and keep its type, so a typo fails loudly instead of
being silently ignored. --help (or -h) lists every key with its default and the comment written
beside it where the defaults are defined (`key=value,  # what it does`), then exits.
"""

import ast
import io
import os
import tokenize


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
    if isinstance(default, list) and isinstance(value, tuple):
        value = list(value)  # --skip_rates=0.1,0.2 (or a = 1, 2 in a file) is a tuple to Python
    elif isinstance(default, list) and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        value = [value]  # --depths=2: a list of one
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(default, bool) and isinstance(value, bool)
    elif isinstance(default, float) and isinstance(value, int):
        value, ok = float(value), True
    else:
        ok = isinstance(value, type(default))
    if not ok:
        hint = f" (a list: --{key}=[a,b] or --{key}=a,b)" if isinstance(default, list) else ""
        raise ConfigError(f"config key '{key}' in {where} expects {type(default).__name__}, "
                          f"got {type(value).__name__} {value!r}{hint}")
    return value


def _literal(text):
    """A --key=value's value: a Python literal, else the bare string (--residual=nag)."""
    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        return text


def key_comments(sources):
    """{key: the comment after it on its line} for the keys of each (path, name) in sources: every
    `name = dict(key=value, ...)` of that file (at module level or in a class body: model.py's mode
    options) or its dataclass `class name: key: type = value`; a callable in sources gives {key: comment}."""
    comments = {}
    for source in sources:
        if callable(source):  # comments made at --help time, e.g. from a registry: {key: comment}
            comments.update(source())
            continue
        path, name = source
        with open(path) as f:
            source = f.read()
        # comments after code on their line (tokenize, so a '#' inside a string is not one)
        after_code = {tok.start[0]: tok.string.lstrip("#").strip()
                      for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                      if tok.type == tokenize.COMMENT and tok.line[:tok.start[1]].strip()}
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name] \
                    and isinstance(node.value, ast.Call):
                keys = [(kw.arg, kw.value.end_lineno) for kw in node.value.keywords]
            elif isinstance(node, ast.ClassDef) and node.name == name:
                keys = [(s.target.id, s.end_lineno) for s in node.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            else:
                continue
            comments.update({key: after_code[line] for key, line in keys if line in after_code})
    return comments


def describe(defaults, help_from):
    """--help's text: one line per key of `defaults`: its name, default and comment (key_comments)."""
    comments = key_comments(help_from)
    width = max(map(len, defaults))
    shown = {key: repr(value) for key, value in defaults.items()}
    value_width = min(24, max(map(len, shown.values())))  # a long default pushes its comment along, alone
    return "\n".join(["keys: set one in a config file (key = value) or as --key=value; default, what it does"] +
                     [f"  {key:<{width}}  {shown[key]:<{value_width}}  {comments.get(key, '')}".rstrip()
                      for key in defaults])


def run_config_file(path, source):
    """The names a config file assigns. A Python error in it is a one-line ConfigError with its file:line."""
    namespace = {}
    try:
        exec(compile(source, path, "exec"), {}, namespace)
    except SyntaxError as e:  # the line is the file's own, also for an IndentationError
        raise ConfigError(f"{path}:{e.lineno}: {type(e).__name__}: {e.msg}; a config file is Python "
                          f"assignments (key = value): fix that line") from None
    except Exception as e:
        tb, line = e.__traceback__, None
        while tb is not None:  # the innermost frame of the file itself (not of what it called)
            if tb.tb_frame.f_code.co_filename == path:
                line = tb.tb_lineno
            tb = tb.tb_next
        where, text = f"{path}:{line}" if line else path, (str(e).splitlines() or [""])[0]
        raise ConfigError(f"{where}: {type(e).__name__}: {text}; a config file is Python assignments "
                          f"(key = value): fix that line") from None
    return namespace


def configure(argv, defaults, help_from=(), about=None):
    """Return a copy of `defaults` updated from config files and --key=value arguments. With --help or
    -h it prints `about` (one line: what the script does and needs), then describe(defaults, help_from),
    and exits: help_from says where `defaults` are written, as (file, dict or dataclass name) pairs whose
    `key=value,  # comment` lines say what each key does."""
    if "--help" in argv or "-h" in argv:
        if about:
            print(about)
        print(describe(defaults, help_from))
        raise SystemExit(0)
    config = dict(defaults)
    for arg in argv:
        if not arg.startswith("--"):
            if "out_dir" in defaults and (os.path.isdir(arg) or not (os.path.exists(arg) or arg.endswith(".py")
                                                                    or "=" in arg)):
                # a run's folder given as the first argument, as plot.py takes them: out_dir is a key here
                what = f"'{arg}' is a folder, not a config file" if os.path.isdir(arg) else \
                    f"config file '{arg}' not found"
                raise ConfigError(f"{what}; for a run's folder write --out_dir={arg}")
            try:
                with open(arg) as f:
                    source = f.read()
            except OSError as e:
                if "=" in arg and not os.path.exists(arg):  # n_layer=8: a key without its --
                    raise ConfigError(f"config file '{arg}' not found; did you mean --{arg.lstrip('-')}?") from None
                raise ConfigError(f"cannot read config file '{arg}': {e.strerror}") from None
            namespace = run_config_file(arg, source)
            for key, value in namespace.items():
                if not key.startswith("_") and not callable(value) and type(value).__name__ != "module":
                    config[key] = _check(key, value, defaults, arg)
        else:
            key, sep, text = arg[2:].partition("=")
            if not sep:
                raise ConfigError(f"expected --key=value, got '{arg}': write {arg}=VALUE, with no spaces")
            value = _literal(text)
            if isinstance(defaults.get(key), list) and isinstance(value, str):  # --residuals=prenorm,nag
                value = [_literal(item.strip()) for item in value.strip("[]").split(",") if item.strip()]
            config[key] = _check(key, value, defaults, f"'{arg}'")
    return config
