"""The CPU server command of docs/vllm.md ("A vLLM server on CPU") starts as written: its lines run in a fresh folder
with bash, only the port changed to a free one, and the server must answer /health and a completion request."""

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from .conftest import SERVER_START_TIMEOUT, free_port, stop, wait_ready

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def documented_commands() -> list[str]:
    """The shell commands of the first bash block after the "A vLLM server on CPU" heading, continuations joined."""
    text = DOC.read_text().split("### A vLLM server on CPU", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, re.DOTALL).group(1)
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_documented_cpu_server_starts_as_written(tmp_path):
    setup, serve = documented_commands()
    assert "VLLM_CPU_KVCACHE_SPACE=" in serve and "--max-model-len" in serve and " --port 8000 " in serve
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])}
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run(["bash", "-c", setup], cwd=tmp_path, env=env, check=True, timeout=300, capture_output=True)
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        ["bash", "-c", serve.replace(" --port 8000 ", f" --host 127.0.0.1 --port {port} ")],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # stop() ends the process group: bash and the server it started
    )
    proc.log_path = str(tmp_path / "server.log")  # what wait_ready shows if the server exits
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, SERVER_START_TIMEOUT)
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps({"model": "tiny-qwen3", "prompt": "copy 1 2 3 :", "max_tokens": 3}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status == 200 and len(json.loads(reply.read())["choices"]) == 1
    finally:
        stop(proc)
        log.close()
