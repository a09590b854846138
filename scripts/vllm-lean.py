"""Print the packages vLLM's scheduler needs on a machine without a GPU.

    python scripts/vllm-lean.py REPORT.json

REPORT.json is pip's resolution of "vllm==X pytest" (pip install --dry-run
--ignore-installed --report). A full install of it is about 9.4 GB: torch
with every CUDA library, and GPU kernel packages (flashinfer, cutlass,
tilelang, ...) the scheduler never imports. This prints the resolved
"name==version" lines without those, for "pip install --no-deps": torch
stays, and of its CUDA libraries only the four the CUDA toolkit lacks (as
in scripts/test-sglang.sh; torch finds the others in the toolkit). triton
goes too (0.9 GB): vLLM runs without it where no GPU is (its
triton_utils), and the scheduler tests pass without it.
"""
import json
import sys

KEEP = {"torch", "nvidia-cufile", "nvidia-cusparselt-cu13",
        "nvidia-nvshmem-cu13", "nvidia-nccl-cu13"}
# packages for running kernels on a GPU, by name or name prefix
GPU = ("torch", "triton", "nvidia-", "cuda-", "flashinfer", "tilelang",
       "humming-kernels", "quack-kernels", "tokenspeed",
       "instanttensor", "fastsafetensors", "nvtx", "pynvvideocodec")

report = json.load(open(sys.argv[1]))
for item in report["install"]:
    meta = item["metadata"]
    name = meta["name"].lower().replace("_", "-")
    if name in KEEP or not name.startswith(GPU):
        print(f"{meta['name']}=={meta['version']}")
