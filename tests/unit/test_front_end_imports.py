"""The HTTP front end loads no torch: its modules, its server arguments with ``--device auto``
(on a torch build without GPU support) and its tokenizer (once the class is recorded) leave
torch unimported, so a server's front end starts in about a CPU second."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from pdserve.envs import cuda_available

CPU_BUILD = not (torch.version.cuda or torch.version.hip)


def _fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cuda_available_agrees_with_torch():
    assert cuda_available() == torch.cuda.is_available()


def test_front_end_modules_and_arguments_import_no_torch(tmp_path):
    got = _fresh(
        "import json, sys\n"
        "from pdserve.server import app, launch, tokenizer_manager, migrate_api, expert_api\n"
        "from pdserve.server import lora_api\n"
        "from pdserve.config import ServerArgs\n"
        "modules = 'torch' in sys.modules\n"
        "hf = 'transformers' in sys.modules\n"
        f"args = ServerArgs(model_path={str(tmp_path)!r}, device='auto')\n"
        "print(json.dumps({'modules': modules, 'args': 'torch' in sys.modules,\n"
        "  'device': args.device, 'transformers': hf}))\n"
    )
    assert not got["modules"] and not got["transformers"]
    assert got["args"] == (not CPU_BUILD)
    assert got["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
