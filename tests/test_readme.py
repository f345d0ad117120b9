"""Every Python sample of README.md and docs/*.md runs as written.

Each block runs in a fresh Python in a temporary directory after a *prelude* that
defines the placeholders the prose leaves to the reader (``model``, ``loader``,
``step``...: see :data:`PRELUDES`); paths under /local and /scratch become temporary
ones.  The README's training script runs unchanged under real ``mpiexec -n 2`` and
``torchrun --nproc-per-node 2`` and must give both ranks the same batches under both.
A block that needs something this machine lacks says why in :data:`SKIP`; one that a
prelude completes starts with a ``# fragment: ... are yours`` line, so the reader knows
too.  Indented blocks (in list items) count.  Every ``forebay`` command of the bash
blocks is parsed by the CLI, and the quick start for ingest runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import BIN

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

DATA = """
import numpy as np, torch, forebay
from forebay.synth import ising_samples
forebay.write_dataset("ising.fb", ising_samples(300, 0))
"""
MODEL = """
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.head = torch.nn.Linear(8, 2)
    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)
model, other_model, new_model = Net(), Net(), Net()
build_model = Net
state_dict = {"w": torch.ones(4, 2), "step": 3}
from safetensors.torch import save_file
save_file({"w": torch.ones(2)}, "model.safetensors")
"""
TRAINING = """
import torch.nn.functional as F
loader = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(3)]
loss_fn = F.mse_loss
step = lambda batch: None
E = 1
"""
FOREBAY_LOADER = """
from forebay.torch import DataLoader, Pipeline
loader = DataLoader("ising.fb", 16, pipeline=Pipeline(prefetch=0))
step = lambda batch: None
E = 1
"""

#: the placeholders each block needs, by a line that identifies the block
PRELUDES = {
    "forebay.write_dataset(\"train.fb\"": "",
    "forebay.trace.enable(\"traces/\")        # or run": DATA + FOREBAY_LOADER,
    "repo = fm.open_repository(\"file:///local/models\")       # LMDB; or": DATA + MODEL,
    "import forebay.reduce as fr\nfr.init_process_group()              # rank and size":
        DATA + MODEL + TRAINING,
    "repo = fm.open_repository(\"file:///local/models\")        # LMDB in": DATA + MODEL,
    "fr.init_process_group()              # rank/size from torchrun": DATA + MODEL + TRAINING,
    "from forebay.sim import simulate": "",
    "loaders = [\n    DataLoader(\"ising.fb\", 128),": DATA,
    "store = DistributedStore.from_arrays(": "",
    "pipeline=Pipeline(views=True))     # any store": "",
    "transform=DecodeCropFlip(224),":
        "from forebay.synth import synthesize\n"
        "from forebay.dataset.sources import get_source, ingest\n"
        "if __name__ == '__main__':\n"
        "    synthesize('imagenet', 'jpg', 64, encode='jpeg')\n"
        "    ingest(get_source('imagefolder', 'jpg'), 'imagenet.fb')\n",
    "ckpt = Checkpoint(\"file:///scratch/run7\"":
        "import numpy as np, torch, forebay\n"
        "forebay.write_dataset('train.fb', [{'x': np.full(4, i, np.float32)} "
        "for i in range(256)])\n"
        "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
    "forebay.write_dataset(\"real.fb\"": "",
    "forebay.write_dataset(\"small.fb\"": "",
    "forebay.write_dataset(\"frames.fb\"": "",
    "mix = Mixture({\"web.fb\": 0.7":
        "import numpy as np, forebay\n"
        "forebay.write_dataset('web.fb', [{'x': np.zeros(4, np.float32)}] * 700)\n"
        "forebay.write_dataset('code.fb', [{'x': np.ones(4, np.float32)}] * 300)\n",
    "mix = Mixture({\"real.fb\": 0.5":
        "import numpy as np, forebay\n"
        "forebay.write_dataset('real.fb', [{'x': np.zeros(4, np.float32)}] * 900)\n"
        "forebay.write_dataset('sim.fb', [{'x': np.ones(4, np.float32)}] * 100)\n",
    "server = serve_dataset(\"/local/frames.fb\"":
        "import numpy as np, forebay\n"
        "forebay.write_dataset('frames.fb', [{'x': np.full(4, i, np.float32)} "
        "for i in range(4096)])\ntoken = 'a-shared-token'\n",
    "forebay.trace.enable(\"traces/\")          # or:": DATA + "E = 1\n"
                                                       "step = lambda batch: None\n",
}
#: blocks that do not run here, and why
SKIP = {
    "tcp://node1:7531": "needs providers on node1 and node2",
    "# train.py": "run under mpiexec and torchrun by test_readme_training_script_*",
}
#: what the prose leaves open inside a block, replaced before running it
SUBST = [("file:///local/models", "file://{tmp}/models"),
         ("file:///scratch/models", "file://{tmp}/scratch"),
         ("file:///scratch/run7", "file://{tmp}/run7"),
         ("/local/ssd", "{tmp}"), ("/local/forebay-cache", "{tmp}/cache"),
         # the producer's server on any free port here, its url from the server
         ('"10.0.0.2:7532"', '"127.0.0.1:0"'), ('"http://10.0.0.2:7532"', "server.url"),
         ("/local/frames.fb", "{tmp}/frames.fb"), ("/local/mirror.fb", "{tmp}/mirror.fb"),
         ("/gpfs/project/frames.fb", "{tmp}/frames.fb"),
         ("forebay.torch.DataLoader(...)", 'forebay.torch.DataLoader("ising.fb", 16)'),
         # two spawned workers on CI's two cores, not four (each imports torch)
         ("workers=4))  # batches", "workers=2))  # batches")]


def python_blocks() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        # indented blocks too (inside a list item), their indent removed
        for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M):
            line = text[:m.start()].count("\n") + 1
            out.append((f"{doc.relative_to(ROOT)}:{line}", textwrap.dedent(m.group(2))))
    return out


BLOCKS = python_blocks()


def _run(code: str, cwd: Path, launcher: list[str] | None = None, timeout: int = 300):
    script = cwd / "block.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
               FOREBAY_TRACE="")
    cmd = (launcher or []) + ([sys.executable] if not launcher or "mpiexec" in launcher[0]
                              else []) + [str(script)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("where, code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_every_python_sample_runs(tmp_path, where, code):
    skip = next((why for key, why in SKIP.items() if key in code), None)
    if skip:
        pytest.skip(skip)
    prelude = next((p for key, p in PRELUDES.items() if key in code), None)
    assert prelude is not None, f"{where}: a new sample; give it a prelude in PRELUDES"
    # a block that leaves something to the reader says so on its first line
    assert not prelude or code.startswith("# fragment: "), \
        f"{where}: completed by a prelude, so it must start '# fragment: ... are yours'"
    for a, b in SUBST:
        code = code.replace(a, b.format(tmp=tmp_path))
    p = _run(prelude + "\n" + code, tmp_path)
    assert p.returncode == 0, f"{where} failed:\n{p.stderr[-3000:]}"


TRAIN_CHECK = """
import json, os
rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK")
           or os.environ.get("SLURM_PROCID") or 0)
ids = []
from forebay.torch import Pipeline, Preload
loader2 = DataLoader("ising.fb", batch_size=128, seed=0, epochs=10, store=Preload(width=2),
                     pipeline=Pipeline(collate_fn=lambda b: b.ids.tolist()))
for epoch in range(2):
    loader2.set_epoch(epoch)
    ids += [b for b in loader2]
loader2.close()
with open(f"ids-{rank}.json", "w") as f:
    json.dump(ids, f)
"""


def test_readme_training_script_runs_as_one_rank_without_a_launcher(tmp_path):
    """README says train.py runs as one rank with plain python: it does."""
    code = next(c for w, c in BLOCKS if "# train.py" in c)
    assert "every_steps=500" in code
    code = code.replace("every_steps=500", "every_steps=5")     # 300 samples: ~25 steps
    assert _run(DATA, tmp_path).returncode == 0
    p = _run(code, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    _assert_saved(tmp_path / "checkpoints")


def _assert_saved(path: Path) -> None:
    from forebay.models import open_repository

    repo = open_repository(str(path), create=False)
    try:
        assert len(repo.versions("checkpoint")) == 2        # keep=2, the older pruned
    finally:
        repo.close()


@pytest.mark.mpi
def test_readme_training_script_runs_unchanged_under_mpiexec_and_torchrun(tmp_path):
    """The README's train.py as written (plus a check of the batches each rank saw),
    under both launchers: same batches, each rank its own half.  Where the emulated
    cluster runs (root, CI), test_cluster.py runs the same script across four nodes
    under mpiexec, torchrun and srun instead (the suite's time)."""
    from cluster import unavailable

    if not unavailable():
        pytest.skip("run across four emulated nodes by test_cluster.py instead")
    code = next(c for w, c in BLOCKS if "# train.py" in c).replace("every_steps=500",
                                                                   "every_steps=5")
    got = {}
    for name, launcher in (("mpiexec", [str(BIN / "mpiexec"), "-n", "2"]),
                           ("torchrun", [str(BIN / "torchrun"), "--standalone",
                                         "--nproc-per-node", "2"])):
        d = tmp_path / name
        d.mkdir()
        assert _run(DATA, d).returncode == 0
        p = _run(code + TRAIN_CHECK, d, launcher)
        assert p.returncode == 0, f"{name}:\n{p.stderr[-3000:]}"
        _assert_saved(d / "checkpoints")
        got[name] = [Path(d, f"ids-{r}.json").read_text() for r in range(2)]
    assert got["mpiexec"] == got["torchrun"]
    assert got["mpiexec"][0] != got["mpiexec"][1]


def shell_commands() -> list[tuple[str, str]]:
    """Every ``forebay ...`` command of the bash blocks of README.md and docs/*.md
    (continuation lines joined, comments dropped)."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^( *)```bash\n(.*?)^\1```", text, re.S | re.M):
            line = text[:m.start()].count("\n") + 1
            body = textwrap.dedent(m.group(2)).replace("\\\n", " ")
            for cmd in body.splitlines():
                cmd = cmd.split("  #")[0].strip()
                if cmd.startswith("forebay "):
                    out.append((f"{doc.relative_to(ROOT)}:{line}", cmd))
    return out


SHELL = shell_commands()


@pytest.mark.parametrize("where, cmd", SHELL, ids=[f"{w} {c[:40]}" for w, c in SHELL])
def test_every_forebay_command_in_the_docs_parses(where, cmd):
    """The commands the docs show are ones the CLI takes (flags renamed or dropped
    fail here); running them is left to the tests of each command, the heavy ones
    (75 s simulations, DLIO) not repeated."""
    import shlex

    from forebay.cli import build_parser

    try:
        build_parser().parse_args(shlex.split(cmd)[1:])
    except SystemExit:
        pytest.fail(f"{where}: `{cmd}` is refused by the CLI")


def test_the_readme_quick_start_for_ingest_runs(tmp_path):
    """README's "Quick start: ingest what you have" block, as written (fewer samples)."""
    block = next(c for w, c in SHELL if c.startswith("forebay synth ising src/"))
    where = next(w for w, c in SHELL if c == block)
    cmds = [c for w, c in SHELL if w == where]
    assert [c.split()[1] for c in cmds] == ["synth", "ingest", "info", "verify"], cmds
    for c in cmds:
        c = c.replace("--samples 10000", "--samples 300")
        p = subprocess.run([str(BIN / "forebay"), *c.split()[1:]], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"`{c}`: {p.stderr[-2000:]}"
