"""A write that fails (a full disk, a file size limit: ``ulimit -f``) names the file it was writing and leaves no
temporary behind: an error read "File too large" and no word of which file, and a truncated ``.tmp`` stayed beside
a policy, a trace, a trace's part and a head's training checkpoint. Each case runs in a process whose files may
not grow past a few KiB (``RLIMIT_FSIZE``; Python ignores the SIGXFSZ that would end it)."""

from __future__ import annotations

import errno
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 4096

WRITERS = {
    "atomic": "from env.files import atomic_write_bytes\natomic_write_bytes(out, b'x' * 100_000)\n",
    "appending": (
        "from env.files import Appending\n"
        "with Appending(out) as fh:\n"
        "    for i in range(10_000):\n"
        "        fh.write(json.dumps({'i': i, 'pad': 'x' * 50}) + '\\n')\n"
    ),
    "policy": (
        "from policies.archive import write_archive\n"
        "write_archive(Path(out), 'meta.json', {}, {'w.bin': os.urandom(100_000)})\n"
    ),
    "checkpoint": (
        "import torch\nfrom drafters.train_checkpoint import save_train_state\n"
        "save_train_state(Path(out), {'step': 1, 'head': {'w': torch.randn(100_000)}}, None)\n"
    ),
    "trace": (
        "import numpy as np\nfrom env.files import writing_temporary\n"
        "with writing_temporary(out, out + '.tmp.npz') as tmp:\n"
        "    np.savez(tmp, a=np.random.rand(100_000))\n"
    ),
}

RUN = """
import json, os, sys
from pathlib import Path
out = sys.argv[1]
try:
{body}
except OSError as err:
    print(json.dumps({{"errno": err.errno, "filename": err.filename}}))
"""


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_failed_write_names_its_file_and_leaves_no_temporary(tmp_path, writer):
    out = tmp_path / "result.bin"
    body = "".join("    " + line + "\n" for line in WRITERS[writer].splitlines())
    got = subprocess.run([sys.executable, "-c", RUN.format(body=body), str(out)], capture_output=True, text=True,
                         cwd=ROOT, preexec_fn=_limited, timeout=120)  # fmt: skip
    assert got.returncode == 0 and got.stdout, got.stderr[-2000:]
    err = json.loads(got.stdout)
    assert err == {"errno": errno.EFBIG, "filename": str(out)}, err
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["result.bin"] if writer == "appending" else []), left  # (the log keeps what fit)
