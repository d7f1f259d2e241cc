"""A deliberately small renderer for the subset of Helm's Go templates that deploy/helm/engramd uses, so that CI can
render the chart without helm (Debian does not package it; npm has no renderer). It is not `helm template`: anything
outside the subset is an error naming the action, never a guess, and a value the templates name that values.yaml
lacks is an error too (helm would print "<no value>"). Where helm is installed, tests/deploy/helm_chart_test.py also
runs `helm template` and requires the same objects from both.

The subset: text; `{{/* comments */}}`; `{{-` / `-}}` trimming; `define`, `include NAME .`; `if` / `else` / `end`,
`with` / `end`, `range` / `end` over a list; pipelines of `quote`, `toYaml`, `nindent N`, `indent N`; conditions
`and`, `or`, `not` over terms in parentheses or bare; terms `.`, `.Values.a.b`, `.Release.Name|Namespace|Service`,
`.Chart.Name|Version|AppVersion`, "strings" and integers."""
import re

import yaml

ACTION = re.compile(r"\{\{(-?)(\s*)(.*?)(\s*)(-?)\}\}", re.S)


class TemplateError(Exception):
    pass


def _tokens(text):
    """[('text', s) | ('action', s)] with the trimming markers applied."""
    out, pos = [], 0
    for m in ACTION.finditer(text):
        chunk = text[pos:m.start()]
        if m.group(1) == "-":
            chunk = chunk.rstrip(" \t\r\n")
        out.append(["text", chunk])
        out.append(["action", m.group(3), m.group(5) == "-"])
        pos = m.end()
    out.append(["text", text[pos:]])
    for i, t in enumerate(out):  # a `-}}` trims the text after it
        if t[0] == "action" and t[2] and i + 1 < len(out):
            out[i + 1][1] = out[i + 1][1].lstrip(" \t\r\n")
    return [(t[0], t[1]) for t in out]


def _parse(tokens, i, stop):
    """Nodes until one of `stop` ('end', 'else'); returns (nodes, index of the stopping token, its word)."""
    nodes = []
    while i < len(tokens):
        kind, s = tokens[i]
        if kind == "text":
            nodes.append(("text", s))
            i += 1
            continue
        if s.startswith("/*"):
            i += 1
            continue
        word = s.split(None, 1)[0] if s else ""
        rest = s[len(word):].strip()
        if word in stop:
            return nodes, i, word
        if word in ("if", "with", "range", "define"):
            body, j, w = _parse(tokens, i + 1, ("end", "else"))
            other = []
            if w == "else":
                if word in ("range", "define"):
                    raise TemplateError(f"`else` in `{word}` is outside the subset")
                other, j, w = _parse(tokens, j + 1, ("end",))
            if w != "end":
                raise TemplateError(f"`{word} {rest}` has no end")
            nodes.append((word, rest, body, other))
            i = j + 1
            continue
        if word in ("end", "else"):
            raise TemplateError(f"unexpected `{word}`")
        if word in ("template", "block", "break", "continue") or ":=" in s or s.startswith("$"):
            raise TemplateError(f"`{s}` is outside the subset")
        nodes.append(("expr", s))
        i += 1
    if stop:
        raise TemplateError(f"missing `{'/'.join(stop)}`")
    return nodes, i, None


def _split_args(s):
    args, depth, cur, quoted = [], 0, "", False
    for ch in s:
        if ch == '"' and depth == 0:
            quoted = not quoted
        if not quoted and ch == "(":
            depth += 1
        if not quoted and ch == ")":
            depth -= 1
        if ch.isspace() and depth == 0 and not quoted:
            if cur:
                args.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        args.append(cur)
    return args


def _truthy(v):
    return not (v is None or v is False or v == 0 or v == "" or v == [] or v == {})


def _to_text(v):
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        raise TemplateError(f"a map or list printed without toYaml: {v!r}")
    return str(v)


def _to_yaml(v):
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n") if v not in (None, {}, []) else ""


class Renderer:
    def __init__(self, values, release, chart):
        self.root = {"Values": values, "Release": release, "Chart": chart}
        self.defines = {}

    def term(self, t, dot):
        if t.startswith("(") and t.endswith(")"):
            return self.pipeline(t[1:-1], dot)
        if t.startswith('"') and t.endswith('"'):
            return t[1:-1]
        if re.fullmatch(r"-?\d+", t):
            return int(t)
        if t == ".":
            return dot
        if t.startswith("."):
            v, path = self.root, t[1:].split(".")
            if path[0] not in ("Values", "Release", "Chart"):
                raise TemplateError(f"`{t}` is outside the subset")
            for part in path:
                if not isinstance(v, dict) or part not in v:
                    raise TemplateError(f"`{t}`: no `{part}` (values.yaml lacks it)")
                v = v[part]
            return v
        raise TemplateError(f"`{t}` is outside the subset")

    def command(self, words, dot, piped):
        fn, args = words[0], words[1:]
        vals = [self.term(a, dot) for a in args] + ([piped[0]] if piped else [])
        if fn in ("quote", "toYaml", "not") and len(vals) == 1:
            v = vals[0]
            return ('"' + _to_text(v).replace('"', '\\"') + '"') if fn == "quote" else \
                _to_yaml(v) if fn == "toYaml" else not _truthy(v)
        if fn in ("nindent", "indent") and len(vals) == 2 and isinstance(vals[0], int):
            pad = " " * vals[0]
            text = "\n".join(pad + line for line in _to_text(vals[1]).split("\n"))
            return ("\n" + text) if fn == "nindent" else text
        if fn in ("and", "or") and len(vals) >= 2:
            if fn == "and":
                return next((v for v in vals if not _truthy(v)), vals[-1])
            return next((v for v in vals if _truthy(v)), vals[-1])
        if fn == "include" and len(vals) == 2:
            if vals[0] not in self.defines:
                raise TemplateError(f"include of an undefined template {vals[0]!r}")
            return self.nodes(self.defines[vals[0]], vals[1])
        if not args and not piped:
            return self.term(fn, dot)
        raise TemplateError(f"`{' '.join(words)}` is outside the subset")

    def pipeline(self, s, dot):
        piped = None
        for part in s.split("|"):
            words = _split_args(part.strip())
            if not words:
                raise TemplateError(f"empty command in `{s}`")
            piped = (self.command(words, dot, piped),)
        return piped[0]

    def nodes(self, nodes, dot):
        out = []
        for n in nodes:
            kind = n[0]
            if kind == "text":
                out.append(n[1])
            elif kind == "expr":
                out.append(_to_text(self.pipeline(n[1], dot)))
            elif kind == "define":
                continue
            elif kind == "if":
                out.append(self.nodes(n[2] if _truthy(self.pipeline(n[1], dot)) else n[3], dot))
            elif kind == "with":
                v = self.pipeline(n[1], dot)
                out.append(self.nodes(n[2], v) if _truthy(v) else self.nodes(n[3], dot))
            elif kind == "range":
                v = self.pipeline(n[1], dot)
                if v is None:
                    continue
                if not isinstance(v, list):
                    raise TemplateError(f"range over a non-list `{n[1]}`")
                out.extend(self.nodes(n[2], item) for item in v)
        return "".join(out)

    def load_helpers(self, text):
        nodes, _, _ = _parse(_tokens(text), 0, ())
        for n in nodes:
            if n[0] == "define":
                self.defines[n[1].strip('"')] = n[2]

    def render(self, text):
        nodes, _, _ = _parse(_tokens(text), 0, ())
        return self.nodes(nodes, self.root)
