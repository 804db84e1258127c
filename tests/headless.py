"""Headless Chromium for the page's browser tests, driven over its DevTools protocol.

No dependency: the protocol's websocket is a few lines of the standard library (one text frame a
message, masked from the client, as RFC 6455 asks). A test evaluates JavaScript in the page, which
clicks buttons as a user does (element.click() dispatches the real click event), and polls with
generous guard times for what the page's own timers draw.
"""

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import time
from pathlib import Path

GUARD_S = 60
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--remote-debugging-port=0")


def find_chromium() -> str | None:
    """Debian's chromium (or CHROMIUM naming another build), None where there is none."""
    given = os.environ.get("CHROMIUM")
    return given if given else next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)


class Browser:
    """A headless Chromium with its own profile folder, and the websocket to it."""

    def __init__(self, executable: str, profile: Path) -> None:
        self.log = (profile.parent / "chromium.log").open("wb")
        self.process = subprocess.Popen([executable, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                        stdout=self.log, stderr=subprocess.STDOUT)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + GUARD_S
        while not (port_file.is_file() and len(port_file.read_text().split()) == 2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not start (see {self.log.name})")
            time.sleep(0.05)
        port, path = port_file.read_text().split()
        self.socket = socket.create_connection(("127.0.0.1", int(port)), timeout=GUARD_S)
        key = base64.b64encode(os.urandom(16)).decode()
        self.socket.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                             f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._receive()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 101"):
            raise RuntimeError(f"chromium refused the DevTools websocket: {head[:80]!r}")
        self.calls = 0

    def _receive(self) -> bytes:
        data = self.socket.recv(1 << 16)
        if not data:
            raise RuntimeError("chromium closed the DevTools websocket")
        return data

    def _take(self, count: int) -> bytes:
        while len(self.buffer) < count:
            self.buffer += self._receive()
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data

    def _message(self) -> str:
        """One whole text message (continuation frames joined; the server's frames are not masked)."""
        parts = []
        while True:
            first, second = self._take(2)
            length = second & 0x7F
            if length == 126:
                length = struct.unpack(">H", self._take(2))[0]
            elif length == 127:
                length = struct.unpack(">Q", self._take(8))[0]
            payload = self._take(length)
            if first & 0x0F == 8:
                raise RuntimeError("chromium closed the DevTools websocket")
            parts.append(payload)
            if first & 0x80:
                return b"".join(parts).decode("utf-8")

    def _send(self, text: str) -> None:
        data, mask = text.encode("utf-8"), os.urandom(4)
        length = len(data)
        header = bytes([0x81]) + (bytes([0x80 | length]) if length < 126 else
                                  bytes([0x80 | 126]) + struct.pack(">H", length) if length < 1 << 16 else
                                  bytes([0x80 | 127]) + struct.pack(">Q", length))
        self.socket.sendall(header + mask + bytes(byte ^ mask[index % 4] for index, byte in enumerate(data)))

    def call(self, method: str, attached: str | None = None, **params) -> dict:
        """A DevTools command's result (`attached`: to the page of that id); the events between are passed over."""
        self.calls += 1
        self._send(json.dumps({"id": self.calls, "method": method, "params": params,
                               **({"sessionId": attached} if attached else {})}))
        while True:
            message = json.loads(self._message())
            if message.get("id") == self.calls:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def page(self) -> "Page":
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        return Page(self, self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"])

    def close(self) -> None:
        if getattr(self, "socket", None):
            self.socket.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=GUARD_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


class Page:
    def __init__(self, browser: Browser, attached: str) -> None:
        self.browser = browser
        self.attached = attached

    def call(self, method: str, **params) -> dict:
        return self.browser.call(method, self.attached, **params)

    def go(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails'].get('exception', {}).get('description')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, guard_s: float = GUARD_S):
        """The first truthy value of `expression`, polled; a failure names it and its last value."""
        deadline = time.monotonic() + guard_s
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError as error:  # the page is still loading its script
                value = error
            if value and not isinstance(value, RuntimeError):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"after {guard_s} s, {expression} is {value!r}")
            time.sleep(0.1)

    def screenshot(self, width: int, height: int) -> bytes:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        return base64.b64decode(self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"])
