"""A context instance in a process of its own, for a test to kill:
publishes one prefill and prints its ContextPhaseParams' endpoint, then
waits to be killed.
  python context_process.py SOCKET INSTANCE_ID TP REQUEST_ID PROMPT_LEN"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                "python"))
sys.path.insert(0, HERE)

import standin  # noqa: E402

standin.install_modules()

import torch  # noqa: E402

from harness import HEAD_DIM, HEADS, LAYERS, Instance  # noqa: E402


def main() -> None:
    sock, iid, tp, rid, n = sys.argv[1:6]
    inst = Instance(sock, iid, int(tp), instance_id=iid)
    reqs = inst.context_requests(int(rid), int(n))
    inst.write(reqs, torch.ones(LAYERS, 2, HEADS, int(n), HEAD_DIM,
                                dtype=torch.float16))
    inst.send(reqs)
    print(reqs[0].context_phase_params.disagg_info_endpoint, flush=True)
    sys.stdin.read()  # until killed


if __name__ == "__main__":
    main()
