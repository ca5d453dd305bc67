"""A front end that breaks what the probes check, for the probe tests: the incident's failures
on any engine. It starts the engine command after `--` (llama.cpp's llama-server, or vLLM's
server, on --upstream-port) and relays every request to it, except:

  --mode placeholder  when the engine refuses a completion with a 4xx, it asks again with the
                      prompt's first token only (the incident's prefill "processed a one-token
                      placeholder") and answers that with 200;
  --mode stale        a prompt asked again after other prompts gets the answer of the last other
                      prompt on the same path (the incident's decode, generating over pages
                      another request wrote);
  --mode truncate     every completion asks vLLM to keep only the prompt's last --truncate tokens
                      (vLLM's `truncate_prompt_tokens`), as a gateway set never to fail a long
                      prompt would: a prompt longer than the window is answered 200.

  placeholder_front.py --port 8080 --upstream-port 8081 [--mode M] -- llama-server ARGS...
  placeholder_front.py --port 8000 --upstream-port 8001 --mode truncate --truncate N -- -m vllm.entrypoints.openai.api_server ARGS...
"""
import argparse
import json
import subprocess
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

a = argparse.ArgumentParser(prog="placeholder_front")
a.add_argument("--port", type=int, default=8080)
a.add_argument("--upstream-port", type=int, required=True)
a.add_argument("--mode", choices=["placeholder", "stale", "truncate"], default="placeholder")
a.add_argument("--truncate", type=int, default=0)
a.add_argument("engine", nargs=argparse.REMAINDER)
args = a.parse_args()
engine = [x for x in args.engine if x != "--"]
subprocess.Popen([sys.executable, *engine])
upstream = f"http://127.0.0.1:{args.upstream_port}"
# stale: every prompt answered so far, and the last prompt and answer, per path.
seen = set()
last = {}


def relay(method, path, body):
    req = urllib.request.Request(upstream + path, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError as e:
        return 503, json.dumps({"error": str(e)}).encode()


class Handler(BaseHTTPRequestHandler):
    def answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.answer(*relay("GET", self.path, None))

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if args.mode == "truncate":
            body = json.dumps(dict(json.loads(body), truncate_prompt_tokens=args.truncate)).encode()
        status, answer = relay("POST", self.path, body)
        if args.mode == "stale" and status == 200:
            prompt = (self.path, json.dumps(json.loads(body).get("prompt")))
            before = last.get(self.path)
            if prompt in seen and before is not None and before[0] != prompt:
                answer = before[1]
            seen.add(prompt)
            last[self.path] = (prompt, answer)
        elif args.mode == "placeholder" and 400 <= status < 500:
            request = json.loads(body)
            prompt = request.get("prompt")
            if isinstance(prompt, list) and prompt:
                request["prompt"] = prompt[:1]
                status, answer = relay("POST", self.path, json.dumps(request).encode())
        self.answer(status, answer)

    def log_message(self, *_):
        pass


ThreadingHTTPServer(("0.0.0.0", args.port), Handler).serve_forever()
