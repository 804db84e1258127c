"""Who may talk to the page's server: this browser tab, through 127.0.0.1, with this launch's token.

The server binds to the loopback interface only, but any web page the user opens can still send
requests to 127.0.0.1. So every request must carry the token printed with the URL (a random value
per launch, compared in constant time); the Host header must name the loopback address and our
port (a DNS-rebinding page reaches us under its own host name); a request that says a page of
another site sent it (Origin, Sec-Fetch-Site) is refused; and what changes anything is a POST
with a JSON body, which a form on another site cannot send without the browser asking first.
"""

import hmac
import secrets
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

TOKEN_HEADER = "X-Launcher-Token"
LOOPBACK_NAMES = ("127.0.0.1", "localhost")
SAME_SITE = ("same-origin", "none")
"""Sec-Fetch-Site values of this page's own requests, and of a URL typed or clicked in the terminal."""


class Refused(Exception):
    """A request the server does not serve: `status` and a one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Guard:
    port: int
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(f"{name}:{self.port}" for name in LOOPBACK_NAMES)

    @property
    def origins(self) -> tuple[str, ...]:
        return tuple(f"http://{host}" for host in self.hosts)

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}?token={self.token}"

    def check(self, method: str, target: str, headers) -> None:
        """Raise Refused unless the request may be served; `headers` is a mapping (case-insensitive get)."""
        if (headers.get("Host") or "").lower() not in self.hosts:
            raise Refused(403, "the Host header must be 127.0.0.1 or localhost with this server's port")
        site = headers.get("Sec-Fetch-Site")
        if site is not None and site not in SAME_SITE:
            raise Refused(403, f"a request from another site ({site}) is refused")
        origin = headers.get("Origin")
        if origin is not None and origin not in self.origins:
            raise Refused(403, f"a request from the origin {origin} is refused")
        given = headers.get(TOKEN_HEADER) or _query_token(target)
        if not hmac.compare_digest(given.encode("utf-8"), self.token.encode("utf-8")):
            raise Refused(403, "missing or wrong token: open the URL `python -m launcher ui` printed")
        if method == "POST":
            if origin is None and site is None:
                raise Refused(403, "a POST must come from the page (it carries Origin or Sec-Fetch-Site)")
            if (headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
                raise Refused(415, "a POST carries a JSON body (Content-Type: application/json)")


def _query_token(target: str) -> str:
    values = parse_qs(urlsplit(target).query).get("token") or [""]
    return values[0]
