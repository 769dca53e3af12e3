"""What may be printed or saved, and what may name a path: one redaction of secrets, one rule for names."""

from __future__ import annotations

import re
from urllib.parse import quote, unquote_plus

from .errors import UsageError

SECRET_KEY = re.compile(r"key|secret|token|passw|pwd|credential|signature|^sig$|auth", re.I)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_WORD = re.compile(r"\S*")
_STOP = re.compile(r"[\s'\"<>]")  # where a URI's host, path and query end in a message
NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]{0,127}")


def redact(text: str | None) -> str | None:
    """`text` fit to print or save: in each URI in it, user:password@ and the values of secret query keys as ***.

    The userinfo is parsed, not matched by pattern: it runs from `scheme://` to the last `@` before the next space
    (or a URI nested in the query), so a password holding any of / @ ? # ' is hidden whole."""
    if not text or "://" not in text:
        return text
    out, pos = [], 0
    while (m := _SCHEME.search(text, pos)) is not None:
        out.append(text[pos:m.end()])
        word = _WORD.match(text, m.end()).group()
        nested = _SCHEME.search(word)
        at = word[:nested.start() if nested else len(word)].rfind("@")
        start = m.end() + at + 1
        if at >= 0:
            out.append("***@")
        stop = _STOP.search(text, start)
        pos = stop.start() if stop else len(text)
        path, sep, query = text[start:pos].partition("?")
        out.append(path + sep + "&".join(map(_redact_pair, query.split("&")) if sep else ()))
    return "".join(out) + text[pos:]


def _redact_pair(pair: str) -> str:
    key, eq, value = pair.partition("=")
    if eq and SECRET_KEY.search(unquote_plus(key)):
        return f"{key}=***"
    inner = unquote_plus(value)  # a URI in a value (endpoint_override=http://user:pw@host) is redacted too
    shown = redact(inner) if "://" in inner else inner
    return pair if shown == inner else f"{key}={quote(shown, safe='/:*@')}"


def check_name(value, what: str, error: type[Exception] | None = None) -> str:
    """`value` if it may name a file or folder: 1-128 letters, digits, '.', '_' or '-', not starting with '.'
    (so never '..', a '/' or a NUL); else one line naming `what` (a UsageError unless `error` is given)."""
    if isinstance(value, str) and NAME.fullmatch(value):
        return value
    shown = repr(redact(value) if isinstance(value, str) else value)
    raise (error or UsageError)(f"{what} {shown[:80]}{'...' if len(shown) > 80 else ''} is not a safe name: "
                                f"use 1-128 letters, digits, '.', '_' or '-', not starting with '.'")


def join_uri(base: str, *names: str) -> str:
    """`base`/names, put before a URI's query: s3://b/runs?region=x + run1 -> s3://b/runs/run1?region=x."""
    path, sep, query = base.partition("?") if "://" in base else (base, "", "")
    return "/".join([path.rstrip("/"), *names]) + sep + query
