"""A fake OpenAI completions server for the E2E matrix tests: ``python fake_openai.py PORT``.

Answers ``/health``, ``/v1/models`` (the model is ``$AFD_E2E_CELL`` or ``fake``) and
``/v1/completions``: the built-in GSM8K-style problem the prompt ends with, answered right
except the tulip problem (answered 0), so the built-in set scores 7/8.  Standard library only.
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from afd_mrv2.probe import gsm8k

MODEL = os.environ.get("AFD_E2E_CELL", "fake")


class Handler(BaseHTTPRequestHandler):
    def _send(self, status: int, doc: object) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, {})
        elif self.path == "/v1/models":
            self._send(200, {"data": [{"id": MODEL}]})
        else:
            self._send(404, {"error": self.path})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        question = body["prompt"].rsplit("Question: ", 1)[1].removesuffix("\nAnswer:")
        if body["model"] != MODEL:
            self._send(404, {"error": f"no model {body['model']}"})
            return
        problem = next(p for p in gsm8k.BUILTIN if p.question == question)
        answer = "0" if "tulips" in question else problem.answer
        self._send(200, {"choices": [{"text": f" Worked it out.\n#### {answer}"}]})

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
