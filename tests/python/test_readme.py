"""The README's Python snippets run as written, in one fresh trainer process against a
real daemon (ACTSTASH_ADDRESS): a small model stands in for `model`, `batch`, `block`,
`x` and `MyBlock`, and what the snippets promise is checked after them (bytes went to
the daemon and came back; the optimizer's states are in the pool)."""
import os
import re
import subprocess
import sys

from conftest import PACKAGE_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRELUDE = """
import torch
torch.manual_seed(0)


class MyBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(256, 256)

    def forward(self, h):
        return torch.nn.functional.gelu(self.linear(h))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([MyBlock(), MyBlock()])

    def forward(self, h):
        for block in self.blocks:
            h = block(h)
        return h.pow(2).mean()


model = Model()
batch = torch.randn(64, 256)
block = model.blocks[0]
x = torch.randn(64, 256, requires_grad=True)
"""

AFTER = """
stats = stash.stats()
assert stats["bytes_offloaded"] > 0 and stats["bytes_fetched"] > 0, stats
assert y.shape == x.shape
loss = model(batch)
loss.backward()  # wrapped: checkpoint+offload per block
assert stash.stats()["bytes_offloaded"] > stats["bytes_offloaded"]
assert opt.offloaded_bytes > 0
opt.step()
print("README snippets ran")
"""


def snippets():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_the_readme_snippets_run_as_written(daemon, tmp_path):
    blocks = snippets()
    assert len(blocks) >= 2, "the README's Python snippets moved: update this test"
    script = tmp_path / "readme_trainer.py"
    script.write_text(PRELUDE + "\n".join(blocks) + AFTER)
    env = dict(os.environ, **PACKAGE_ENV, ACTSTASH_ADDRESS=daemon.socket)
    env.pop("ACTSTASH_START", None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "README snippets ran" in done.stdout
