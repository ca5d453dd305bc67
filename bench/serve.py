"""What bench/peer.py's servers share: a free loopback port, JSON over HTTP, and a server process
whose log goes to a file (a pipe nobody reads fills up and stalls the server's every write)."""

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, stream=False):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    return urllib.request.urlopen(req, timeout=600) if stream else json.load(urllib.request.urlopen(req, timeout=600))


class Process:
    """`cmd` started with its output in a temporary file, and waited for until `ready_url` answers."""

    def __init__(self, name, cmd, ready_url, env=None):
        self.name = name
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                self.ready = urllib.request.urlopen(ready_url, timeout=2).read()
                return
            except OSError:
                if self.proc.poll() is not None:
                    sys.exit(f"{name} exited: {self.tail()}")
                time.sleep(0.2)
        sys.exit(f"{name} did not answer within 120 s: {self.tail()}")

    def tail(self):
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def close(self):
        self.proc.terminate()
        self.proc.wait()
        self.log.close()
