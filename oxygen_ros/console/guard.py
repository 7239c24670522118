"""Who may use the console: the checks every request passes before a handler sees it (plain Python, no
aiohttp and no ROS, so that they are tested alone).

The console can move the robot, and a browser is a confused deputy: any page it shows may send requests
to 127.0.0.1. So, for every request, in this order:
  1. Host: a name of this console (localhost, 127.0.0.1, ::1, the address it listens on, `allowed_hosts`).
     A DNS-rebinding page reaches 127.0.0.1 under the attacker's name, which the Host header carries.
     The port is not checked: an SSH tunnel (`ssh -L 9000:127.0.0.1:8080`) changes it.
  2. Origin and Sec-Fetch-Site, when the browser sends them: this console's own origin only. Another
     page (another site or another port of this host) is refused even when it has the token.
  3. The token (a header, `Authorization: Bearer`, or `?token=` for the page and its pictures, which an
     <img> cannot send a header for), compared in constant time. A page on another origin cannot read it.
  4. Changes (POST) carry `Content-Type: application/json`: a cross-origin "simple" request (text/plain,
     form data) is sent by a browser without asking first; JSON never is.
"""
from __future__ import annotations

import hmac
import ipaddress
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
TOKEN_HEADER = "X-Oxygen-Token"
MIN_TOKEN_CHARS = 16
TOKEN_BYTES = 24                      # secrets.token_urlsafe(24): 32 characters, 192 bits


@dataclass(frozen=True)
class Refusal:
    status: int                       # 401, 403 or 415
    reason: str


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def read_token(path: str, what: str = "token_file") -> str:
    """The token kept in `path` (its first word). ValueError when the file is missing, too short, or
    readable by other users (the token is the key to the robot). `what` names the setting in the message
    (the console's token_file, oxygen_serve's --api-key-file)."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        lines = file.read_text().split()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path}: {getattr(e, 'strerror', None) or e}") from None
    token = lines[0] if lines else ""
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{what} {path} can be read by other users (mode {stat.S_IMODE(mode):o}): "
                         f"chmod 600 {path}")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{what} {path}: the token has {len(token)} characters, at least {MIN_TOKEN_CHARS} "
                         f"are needed (e.g. python -c 'import secrets; print(secrets.token_urlsafe(24))' > {path})")
    return token


def host_name(host_header: str) -> str:
    """'127.0.0.1:8080' -> '127.0.0.1', '[::1]:8080' -> '::1', 'Example.org' -> 'example.org'."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


class RequestGuard:
    def __init__(self, token: str, listen_host: str, allowed_hosts: tuple[str, ...] = ()):
        self.token = token
        names = set(LOCAL_NAMES) | {h.lower() for h in allowed_hosts if h}
        if listen_host not in ("0.0.0.0", "::", ""):
            names.add(listen_host.lower())
        self.names = frozenset(names)

    def check(self, method: str, headers, query_token: str | None, content_type: str) -> Refusal | None:
        """None when the request may go on, else why not. `headers`: a case-insensitive mapping."""
        host = headers.get("Host", "")
        if host_name(host) not in self.names:
            return Refusal(403, f"Host {host!r} is not a name of this console (DNS rebinding protection): open "
                                f"it as http://127.0.0.1:<port>/, or add the name to oxygen_console.allowed_hosts")
        origin = headers.get("Origin")
        if origin is not None and origin.lower() not in (f"http://{host}".lower(), f"https://{host}".lower()):
            return Refusal(403, f"Origin {origin!r} is not this console's: requests from other pages are refused")
        site = headers.get("Sec-Fetch-Site")
        if site is not None and site not in ("same-origin", "none"):
            return Refusal(403, f"Sec-Fetch-Site {site!r}: requests from other pages are refused")
        given = headers.get(TOKEN_HEADER) or _bearer(headers.get("Authorization", "")) or query_token or ""
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return Refusal(401, "no valid token: open the console with the URL oxygen_bringup printed at start "
                                f"(http://127.0.0.1:<port>/?token=...), or send the token in {TOKEN_HEADER}")
        if method == "POST" and content_type != "application/json":
            return Refusal(415, f"Content-Type {content_type or 'none'!r}: changes take application/json only")
        return None


def _bearer(value: str) -> str:
    scheme, _, credentials = value.partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else ""

