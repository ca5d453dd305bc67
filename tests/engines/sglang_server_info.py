"""What an SGLang server says about itself, for the engine tests: SGLang needs CUDA (or an AMX
CPU) and cannot run on the machines kvgate is tested on. This answers GET /health and
GET /get_server_info as `python -m sglang.launch_server` would with the same flags, the body
built from SGLang's source (sgl-project/sglang 0.5.x, `http_server.py` get_server_info: the
server arguments merged with the scheduler's `get_init_info`):

  max_total_num_tokens  the KV pool; a GPU's memory decides it, --max-total-tokens caps it (the
                        tests give the incident's pool here)
  max_req_input_len     min(context_len - 1, max_total_num_tokens - 1), the tp worker
  context_length        the --context-length server argument (null: the model's own)

Run in the llama.cpp test image (python3.11, standard library only). It generates nothing: a
revision it stands in for is refused by the gate before anything is asked of it.
"""
import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

a = argparse.ArgumentParser(prog="sglang_server_info")
a.add_argument("--model-path", required=True)
a.add_argument("--served-model-name")
a.add_argument("--context-length", type=int)
a.add_argument("--max-total-tokens", type=int, required=True)
a.add_argument("--disaggregation-mode", default="null", choices=["null", "prefill", "decode"])
a.add_argument("--host", default="0.0.0.0")
a.add_argument("--port", type=int, default=30000)
a.add_argument("--page-size", type=int, default=1)
args, _ = a.parse_known_args()

context_len = args.context_length or 131072
info = {
    "model_path": args.model_path,
    "served_model_name": args.served_model_name or args.model_path,
    "context_length": args.context_length,
    "disaggregation_mode": args.disaggregation_mode,
    "page_size": args.page_size,
    "host": args.host,
    "port": args.port,
    "max_total_num_tokens": args.max_total_tokens,
    "max_req_input_len": min(context_len - 1, args.max_total_tokens - 1),
    "status": "ready",
    "version": "0.5.21",
    "internal_states": [{"last_gen_throughput": 0.0}],
}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/health": b"", "/get_server_info": json.dumps(info).encode()}.get(self.path.split("?")[0])
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
