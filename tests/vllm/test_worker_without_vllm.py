"""The vLLM connector's worker half where vLLM is not installed (the GPU
machine has none): tests/gpu/vllm_layerwise.py's shim gives it the vLLM
classes it imports. Here its real-model check runs on the CPU with vLLM
hidden (this venv's packages less vLLM's), so a new vLLM import in the
worker half fails make test-vllm, not only make test-gpu."""

import os
import site
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def test_worker_half_layerwise_without_vllm(tmp_path):
    pkgs = tmp_path / "site"
    pkgs.mkdir()
    for sp in site.getsitepackages():
        for name in os.listdir(sp):
            if name == "vllm" or name.startswith("vllm-"):
                continue
            if not (pkgs / name).exists():
                os.symlink(os.path.join(sp, name), pkgs / name)
    build = os.environ.get("KVX_BUILD", "build")
    env = dict(os.environ, PYTHONPATH=str(pkgs))
    # -S: no site-packages of the venv, so vLLM cannot be imported
    out = subprocess.run(
        [sys.executable, "-S", os.path.join(REPO, "tests", "gpu",
                                            "vllm_layerwise.py"),
         "test", "--device", "cpu",
         "--kvxferd", os.path.join(REPO, build, "kvxferd")],
        env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert "2 passed, 0 failed" in text, text[-3000:]
    assert out.returncode == 0, text[-3000:]
